"""How a model dir says its model chats (a Hugging Face dir, or a qkv run dir given the same files), read
wherever transformers reads it: the chat template from `chat_template.jinja` or tokenizer_config.json's
`chat_template` (a Jinja string, or a list of named ones of which "default" is used), the BOS token's text,
and the ids that end a turn: generation_config.json's `eos_token_id` (an id or a list), else config.json's."""
from __future__ import annotations

import json
from pathlib import Path

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
