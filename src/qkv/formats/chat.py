"""A model's chat, in one home: what its file says about chatting, and the template that turns messages into
the prompt it continues. Chat, serve, SFT and DPO all render through `template_for`.

Reading a model dir (a Hugging Face dir, or a qkv run dir given the same files; qkv.formats.gguf reads a GGUF
file's tokenizer.chat_template), wherever transformers reads it: the template from `chat_template.jinja` or
tokenizer_config.json's `chat_template` (a Jinja string, or a list of named ones of which "default" is used),
the BOS token's text, and the ids that end a turn: generation_config.json's `eos_token_id` (an id or a list),
else config.json's.

Rendering, as transformers renders (messages, add_generation_prompt, bos_token, eos_token, raise_exception) in
Jinja's immutable sandbox, so a template can compute a string and nothing else; its special tokens
("<|im_start|>", "<s>") are then read as the tokens they name (as in transformers, a message that spells one
gets that token).

qkv's own runs have no template; they get DEFAULT_TEMPLATE, plain text a small model can learn to follow:

    [end-of-text] System: ...\\nUser: ...\\nAssistant: ...\\nUser: ...\\nAssistant:

(the start token by id, the text encoded as plain text: a message cannot spell a special token), and the
reply stops at the model's end-of-text token or before the next "\\nUser:" (DEFAULT_STOP).
"""
from __future__ import annotations

import json
from pathlib import Path

from qkv.data.tokenizer import EOS, Tokenizer
from qkv.errors import QkvError
from qkv.files import read_json
from qkv.formats.base import Chat

TEMPLATE_FILE = "chat_template.jinja"


def read_chat(path: Path, hf: dict, vocab_size: int | None = None) -> Chat:
    path = Path(path)
    config_file = path / "tokenizer_config.json"
    config = read_json(config_file) if config_file.is_file() else {}
    config = config if isinstance(config, dict) else {}
    source = config.get("chat_template")
    if isinstance(source, list):  # [{"name": ..., "template": ...}]
        named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
        source = named.get("default")
    if (path / TEMPLATE_FILE).is_file():
        source = (path / TEMPLATE_FILE).read_text(encoding="utf-8")
    if source is not None and not isinstance(source, str):
        raise QkvError(f"{config_file}: chat_template must be a string, got {json.dumps(source)[:60]}")
    bos = config.get("bos_token")
    bos = bos.get("content") if isinstance(bos, dict) else bos
    return Chat(template=source, bos_token=bos if isinstance(bos, str) else "", stop_ids=stop_ids(path, hf, vocab_size))


def stop_ids(path: Path, hf: dict, vocab_size: int | None) -> tuple[int, ...]:
    generation = read_json(path / "generation_config.json") if (path / "generation_config.json").is_file() else {}
    ids = generation.get("eos_token_id") if isinstance(generation, dict) else None
    ids = hf.get("eos_token_id") if ids is None else ids
    ids = [ids] if isinstance(ids, int) else ids if isinstance(ids, list) else []
    return tuple(dict.fromkeys(i for i in ids if isinstance(i, int) and not isinstance(i, bool) and i >= 0
                               and (vocab_size is None or i < vocab_size)))


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
