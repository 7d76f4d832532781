"""A Hugging Face tokenizer.json as a qkv `Tokenizer`.

qkv's Tokenizer needs an end-of-text token spelled `<|endoftext|>` (it starts every prompt and scored text
and stops generation). GPT-2's tokenizer has it. For the others, the checkpoint's own EOS token (from
tokenizer_config.json / special_tokens_map.json `eos_token`, else config.json `eos_token_id`, else the
separator `sep_token` of BERT-style tokenizers) is renamed `<|endoftext|>` everywhere it is spelled in the
JSON: ids are unchanged, only that token's text differs (docs/DEVIATIONS.md). Padding and truncation
settings are dropped (qkv encodes one whole text; its batches pad themselves). The original JSON is kept
(`ORIGINAL` in a converted run dir) and written back by `qkv.formats.hf.save`.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from qkv.files import read_json
from qkv.data.tokenizer import EOS, Tokenizer
from qkv.errors import QkvError
from qkv.formats.hf.files import TOKENIZER

ORIGINAL = "hf_tokenizer.json"  # a converted run's unmodified HF tokenizer.json
SPECIAL_FILES = ("tokenizer_config.json", "special_tokens_map.json")


def read_tokenizer(path: Path, hf: dict) -> tuple[Tokenizer | None, str | None]:
    """(qkv tokenizer, original tokenizer.json text); (None, None) when the dir has no tokenizer.json."""
    file = Path(path) / TOKENIZER
    if not file.is_file():
        return None, None
    original = file.read_text(encoding="utf-8")
    raw = read_json(file)
    if not isinstance(raw, dict) or not isinstance(raw.get("model"), dict):
        raise QkvError(f"{file}: not a tokenizers JSON file (no model)")
    raw = {**raw, "padding": None, "truncation": None}  # qkv encodes one text, whole
    if not spells(raw, EOS):
        name = eos_name(Path(path), hf, raw)
        if name is None:
            return None, original
        raw = respell(raw, name, EOS)
    return Tokenizer.from_str(json.dumps(raw, ensure_ascii=False), source=str(file)), original


def eos_name(path: Path, hf: dict, raw: dict) -> str | None:
    """The added token that ends a text: `eos_token` of the tokenizer files, else config.json's
    `eos_token_id`, else `sep_token` (BERT-style tokenizers have no EOS)."""
    special = {}
    for name in reversed(SPECIAL_FILES):  # tokenizer_config.json wins
        content = read_json(path / name) if (path / name).is_file() else None
        special.update(content if isinstance(content, dict) else {})
    by_id = {entry["id"]: entry["content"] for entry in raw.get("added_tokens", [])}
    eos_id = hf.get("eos_token_id")
    eos_id = eos_id[0] if isinstance(eos_id, list) and eos_id else eos_id
    for token in (_content(special.get("eos_token")), by_id.get(eos_id), _content(special.get("sep_token"))):
        if isinstance(token, str) and spells(raw, token):
            return token
    return None


def _content(token):  # tokenizer files write a special token as a string or as {"content": ...}
    return token.get("content") if isinstance(token, dict) else token


def spells(raw: dict, token: str) -> bool:
    return any(entry.get("content") == token for entry in raw.get("added_tokens", []))


def respell(raw: dict, old: str, new: str) -> dict:
    """Every occurrence of the string `old` as a token (added tokens, the model's vocabulary, the
    post-processor's templates) becomes `new`."""
    raw = dict(raw)
    raw["added_tokens"] = [{**e, "content": new} if e.get("content") == old else e for e in raw["added_tokens"]]
    raw["post_processor"] = _replace(raw.get("post_processor"), old, new)
    model = dict(raw["model"])
    vocab = model.get("vocab")
    if isinstance(vocab, dict):  # BPE, WordPiece, WordLevel
        model["vocab"] = {(new if token == old else token): i for token, i in vocab.items()}
    elif isinstance(vocab, list):  # Unigram: [piece, score] pairs
        model["vocab"] = [[new, score] if piece == old else [piece, score] for piece, score in vocab]
    raw["model"] = model
    return raw


def _replace(node: Any, old: str, new: str) -> Any:
    if isinstance(node, str):
        return new if node == old else node
    if isinstance(node, list):
        return [_replace(item, old, new) for item in node]
    if isinstance(node, dict):
        return {_replace(key, old, new): _replace(value, old, new) for key, value in node.items()}
    return node


def hf_tokenizer_files(tokenizer: Tokenizer | None, original: str | None, max_len: int,
                       decoder: bool) -> dict[str, str]:
    """tokenizer.json (the original when there is one) and a tokenizer_config.json for AutoTokenizer; a
    decoder's EOS is named there by its original spelling."""
    if original is None and tokenizer is None:
        return {}
    text = original if original is not None else tokenizer.to_str()
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": max_len}
    if decoder and tokenizer is not None:
        by_id = {entry["id"]: entry["content"] for entry in json.loads(text).get("added_tokens", [])}
        config["eos_token"] = by_id.get(tokenizer.eos_id, EOS)
    return {TOKENIZER: text, "tokenizer_config.json": json.dumps(config, indent=2) + "\n"}
