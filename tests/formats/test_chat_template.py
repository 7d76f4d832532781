"""Chat prompts (qkv.formats.chat): a model's own chat template renders as transformers' apply_chat_template
renders it (the oracle); the sandbox refuses a template that reaches outside its strings; the default
template's text and stop."""

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers.models import WordLevel
from transformers import PreTrainedTokenizerFast

from qkv.errors import QkvError
from qkv.formats.base import Chat
from qkv.formats.chat import DEFAULT_STOP, ChatTemplate, template_for

CHATML = ("{{ bos_token }}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
GUARDED = ("{% for m in messages %}{% if m['role'] == 'system' and not loop.first %}"
           "{{ raise_exception('system first') }}{% endif %}[{{ m['role'] }}] {{ m['content'] }} {% endfor %}")
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Who is Lear?"},
            {"role": "assistant", "content": "A king."}, {"role": "user", "content": "And Cordelia?"}]


def transformers_render(template: str, messages: list[dict], bos: str) -> str:
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=HFTokenizer(WordLevel({"<s>": 0, "x": 1}, unk_token="x")),
                                        bos_token=bos)
    tokenizer.chat_template = template
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


@pytest.mark.parametrize("template", [CHATML, GUARDED])
def test_a_template_renders_as_transformers_renders_it(template):
    assert ChatTemplate(template, None, bos="<s>").render(MESSAGES) == transformers_render(template, MESSAGES, "<s>")


def test_raise_exception_and_the_sandbox_refuse_in_one_message():
    bad = [MESSAGES[1], MESSAGES[0]]  # a system message after the first
    with pytest.raises(ValueError, match="refused the messages: system first"):
        ChatTemplate(GUARDED, None).render(bad)
    escape = "{{ messages.__class__.__mro__[1].__subclasses__() }}"  # no Python objects from a template
    with pytest.raises(ValueError, match="refused the messages"):
        ChatTemplate(escape, None).render(MESSAGES)
    with pytest.raises(QkvError, match="does not parse"):
        ChatTemplate("{% for m in messages %}", None)


class Tokens:
    """A stand-in tokenizer: one id per character, end-of-text 0."""

    eos_id = 0

    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text]


def test_without_a_template_the_default_is_plain_text_after_end_of_text():
    template = template_for(Chat(), Tokens())
    ids, stop = template(MESSAGES[:2])
    assert ids[0] == 0 and "".join(map(chr, ids[1:])) == "System: Be brief.\nUser: Who is Lear?\nAssistant:"
    assert stop == DEFAULT_STOP == ("\nUser:",)
