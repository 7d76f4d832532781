"""Chat messages -> the prompt a model continues: the model's own chat template, or qkv's plain default.

A model's file may carry a chat template (qkv.formats reads it: an HF dir's tokenizer_config.json or
chat_template.jinja, a GGUF file's tokenizer.chat_template, a converted run's chat.json). It is rendered as transformers renders it (messages, add_generation_prompt,
bos_token, eos_token, raise_exception) in Jinja's immutable sandbox, so a template can compute a string and
nothing else; its special tokens ("<|im_start|>", "<s>") are then read as the tokens they name (as in
transformers, a message that spells one gets that token).

qkv's own runs have no template; they get DEFAULT_TEMPLATE, plain text a small model can learn to follow:

    [end-of-text] System: ...\\nUser: ...\\nAssistant: ...\\nUser: ...\\nAssistant:

(the start token by id, the text encoded as plain text: a message cannot spell a special token), and the
reply stops at the model's end-of-text token or before the next "\\nUser:" (DEFAULT_STOP).
"""
from __future__ import annotations

from qkv.data.tokenizer import EOS, Tokenizer
from qkv.errors import QkvError
from qkv.formats.base import Chat

DEFAULT_TEMPLATE = ("{% for m in messages %}{{ m.role | capitalize }}: {{ m.content }}\n{% endfor %}"
                    "{% if add_generation_prompt %}Assistant:{% endif %}")
DEFAULT_STOP = ("\nUser:",)


class ChatTemplate:
    def __init__(self, source: str, tokenizer: Tokenizer, *, bos: str = EOS, specials: bool = False,
                 stop: tuple[str, ...] = (), prefix: tuple[int, ...] = ()):
        from jinja2 import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise
        try:
            self.template = env.from_string(source)
        except TemplateError as exc:
            raise QkvError(f"chat_template does not parse: {exc}") from None
        self.tokenizer, self.bos, self.specials, self.stop = tokenizer, bos, specials, stop
        self.prefix = list(prefix)  # ids before the rendered text

    def render(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        from jinja2 import TemplateError

        try:
            return self.template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                        bos_token=self.bos, eos_token=EOS)
        except TemplateError as exc:
            raise ValueError(f"the model's chat template refused the messages: {exc}") from None

    def __call__(self, messages: list[dict]) -> tuple[list[int], tuple[str, ...]]:
        """messages -> (prompt ids, the stop strings the template implies)."""
        return self.prefix + self.encode(self.render(messages)), self.stop

    def encode(self, text: str) -> list[int]:
        """Rendered text -> ids (a special token's text is that token where the template is the model's own)."""
        return self.tokenizer.encode_with_specials(text) if self.specials else self.tokenizer.encode(text)


def _raise(message: str):
    from jinja2 import TemplateError

    raise TemplateError(message)


def template_for(chat: Chat, tokenizer: Tokenizer) -> ChatTemplate:
    """The model's chat template (qkv.formats: an HF dir's, a GGUF file's, a run's chat.json), else qkv's default."""
    if chat.template is None:
        return ChatTemplate(DEFAULT_TEMPLATE, tokenizer, stop=DEFAULT_STOP, prefix=(tokenizer.eos_id,))
    return ChatTemplate(chat.template, tokenizer, bos=chat.bos_token, specials=True)
