"""The tokenizer a GGUF file describes in its metadata (`tokenizer.ggml.*`), built with Hugging Face
`tokenizers` the way transformers' GGUF loader builds it, so both give the same ids:

    model "gpt2":  byte-level BPE: `tokens` (in the byte alphabet; any other spelling is mapped to it) with
                   `merges`; the pre-tokenizer splits as the vocabulary was trained (`pre`: GPT-2's regex, or
                   Qwen2's / Llama 3's split before the byte mapping).
    model "llama": SentencePiece's BPE (TinyLlama, Llama 2, Gemma): pieces spelled with "▁" for a space, byte
                   fallback to the <0xNN> tokens, a "▁" put before the text unless `add_space_prefix` is false
                   (Gemma); the merges the file gives, or those its scores imply (`implied_merges`). Gemma's
                   files store the pieces of 2+ spaces as spaces and rank merges by the pieces' order, not
                   their scores: both as transformers' GGUF loader reads them.
    Either way tokens typed CONTROL (3) are special tokens, USER_DEFINED (4) added tokens, both matched whole, and
    a file that adds its BOS token (`add_bos_token`; SentencePiece files that do not say) gets a post-processor
    naming it, which qkv's Tokenizer.start_id reads: every prompt then starts with <bos>.

The end-of-text token qkv needs (`<|endoftext|>`) is the file's own when it has one, else its EOS token
respelled, as for Hugging Face dirs (qkv.formats.hf.tokenizer, docs/DEVIATIONS.md).
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers

from qkv.data.dataset import default_cache_dir
from qkv.data.tokenizer import EOS, Tokenizer, bytes_to_unicode
from qkv.errors import QkvError
from qkv.heap import return_freed
from qkv.formats.hf.tokenizer import respell, spells

CONTROL, USER_DEFINED = 3, 4
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
               r"|\s+(?!\S)|\s+")
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
SPLITS = {"qwen2": QWEN2_SPLIT, "deepseek-r1-qwen": QWEN2_SPLIT, "llama3": LLAMA3_SPLIT, "llama-v3": LLAMA3_SPLIT,
          "llama-bpe": LLAMA3_SPLIT, "smaug-bpe": LLAMA3_SPLIT, "dbrx": LLAMA3_SPLIT}  # tokenizer.ggml.pre


def cached_tokenizer(meta: dict, origin: str) -> Tokenizer:
    """gguf_tokenizer(meta, origin), kept as its tokenizer.json text under the cache (QKV_CACHE, by default
    ~/.cache/qkv: tokenizers/KEY.json), KEY the SHA-256 of the file's tokenizer metadata, this module's source
    and the tokenizers version: a later load of any file with that tokenizer reads the JSON instead of deriving
    it again (Gemma 3's 262,144 pieces and their implied merges: 5.5 s -> 1.3 s, of which tokenizers' own
    reading of the JSON takes 1.2; SmolLM2 0.37 -> 0.11 s; 2026-12-07, the AMD EPYC). An entry that cannot
    be read or written is derived again; nothing else is kept. The heap's pages freed meanwhile are returned
    to the system (qkv.heap.return_freed): reading Gemma 3's JSON leaves 290 MB of them."""
    tokenizer = kept_tokenizer(meta, origin)
    return_freed()
    return tokenizer


def kept_tokenizer(meta: dict, origin: str) -> Tokenizer:
    key = hashlib.sha256(Path(__file__).read_bytes() + tokenizers.__version__.encode())
    try:
        for name in sorted(meta):
            if name.startswith("tokenizer.") or name == "general.architecture":
                key.update(json.dumps([name, meta[name]], ensure_ascii=False).encode())
    except (TypeError, ValueError):  # (a value JSON does not write: derived every time)
        return gguf_tokenizer(meta, origin)
    entry = default_cache_dir() / "tokenizers" / f"{key.hexdigest()}.json"
    try:
        return Tokenizer.from_str(entry.read_text(encoding="utf-8"), source=str(entry))
    except (OSError, UnicodeError, QkvError):
        pass
    tokenizer = gguf_tokenizer(meta, origin)
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        written = entry.with_name(f"{entry.name}.{os.getpid()}.tmp")
        written.write_text(tokenizer.to_str(), encoding="utf-8")
        os.replace(written, entry)  # (whole, or not at all: another process may read it meanwhile)
    except OSError:
        pass
    return tokenizer


def gguf_tokenizer(meta: dict, origin: str) -> Tokenizer:
    kind = meta.get("tokenizer.ggml.model")
    if kind is None or "tokenizer.ggml.tokens" not in meta:
        raise QkvError(f"{origin}: has no tokenizer (no tokenizer.ggml.model / tokenizer.ggml.tokens)")
    if kind not in BUILDERS:
        raise QkvError(f"{origin}: tokenizer.ggml.model={kind!r} is not supported; qkv reads "
                       f"{', '.join(sorted(BUILDERS))} ('gpt2': byte-level BPE of GPT-2, SmolLM, Qwen2, Llama 3; "
                       f"'llama': SentencePiece BPE of TinyLlama, Llama 2)")
    tokens = list(meta["tokenizer.ggml.tokens"])
    types = list(meta.get("tokenizer.ggml.token_type", [1] * len(tokens)))
    if len(types) != len(tokens) or not all(isinstance(t, str) for t in tokens):
        raise QkvError(f"{origin}: tokenizer.ggml.token_type has {len(types)} entries for {len(tokens)} tokens")
    try:
        hf, vocab, controls = BUILDERS[kind](meta, tokens)
    except Exception as exc:  # tokenizers raises plain Exception on a merge of unknown tokens
        raise QkvError(f"{origin}: the tokenizer's merges do not fit its vocabulary ({str(exc)[:100]})") from None
    hf.add_special_tokens([AddedToken(t, special=True, normalized=False) for t, kind_ in zip(tokens, types)
                           if kind_ == CONTROL and controls(t)])
    hf.add_tokens([AddedToken(t, special=False, normalized=False) for t, kind_ in zip(tokens, types)
                   if kind_ == USER_DEFINED and t in vocab])
    raw = json.loads(hf.to_str())
    bos = token_of(meta, "bos", tokens)
    if meta.get("tokenizer.ggml.add_bos_token", kind == "llama") and bos is not None and bos != token_of(meta, "eos", tokens):
        raw["post_processor"] = {"type": "TemplateProcessing", "single": [{"SpecialToken": {"id": bos, "type_id": 0}},
                                                                        {"Sequence": {"id": "A", "type_id": 0}}],
                                 "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
                                 "special_tokens": {bos: {"id": bos, "ids": [tokens.index(bos)], "tokens": [bos]}}}
    if not spells(raw, EOS):
        eos = token_of(meta, "eos", tokens)
        if eos is None or not spells(raw, eos):
            raise QkvError(f"{origin}: the tokenizer has no {EOS} token and no special EOS token to stand for it")
        raw = respell(raw, eos, EOS)
    return Tokenizer.from_str(json.dumps(raw, ensure_ascii=False), source=origin)


def byte_level(meta: dict, tokens: list[str]):
    """(tokenizer, vocab, which CONTROL tokens to add) of a byte-level BPE (`gpt2`)."""
    table = bytes_to_unicode()
    alphabet = set(table.values())
    vocab = {}
    for index, token in enumerate(tokens):
        spelled = token if set(token) <= alphabet else "".join(table[b] for b in token.encode("utf-8"))
        vocab.setdefault(spelled, index)
    pairs = [tuple(merge.split(" ")) for merge in meta.get("tokenizer.ggml.merges", [])]
    hf = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=pairs))
    split = SPLITS.get(meta.get("tokenizer.ggml.pre"))
    hf.pre_tokenizer = (pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True) if split is None else
                        pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(split), behavior="isolated"),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]))
    hf.decoder = decoders.ByteLevel()
    # a CONTROL token spelled outside the byte alphabet is a mislabelled one (transformers skips it too)
    return hf, vocab, lambda token: set(token) <= alphabet


def sentencepiece(meta: dict, tokens: list[str]):
    """(tokenizer, vocab, which CONTROL tokens to add) of SentencePiece's BPE (`llama`)."""
    gemma = str(meta.get("general.architecture", "")).startswith("gemma")
    if gemma:  # pieces of spaces alone are stored as spaces: spelled with "▁" as the merges need them
        tokens = ["▁" * len(t) if t and not t.strip(" ") else t for t in tokens]
    vocab = {}
    for index, token in enumerate(tokens):
        vocab.setdefault(token, index)
    merges = meta.get("tokenizer.ggml.merges")
    scores = ({token: -float(index) for index, token in enumerate(tokens)} if gemma else  # ranked by their order
              dict(zip(tokens, meta.get("tokenizer.ggml.scores", [0.0] * len(tokens)))))
    pairs = [tuple(merge.split(" ")) for merge in merges] if merges is not None else implied_merges(vocab, scores)
    hf = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=True, byte_fallback=True,
                                         unk_token=token_of(meta, "unknown", tokens)))
    if meta.get("tokenizer.ggml.add_space_prefix", True):
        hf.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
        strip = [decoders.Strip(content=" ", left=1, right=0)]
    else:  # every space a "▁", none put before the text (Gemma)
        hf.normalizer = normalizers.Replace(" ", "▁")
        strip = []
    hf.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), *strip])
    return hf, vocab, lambda token: True


def implied_merges(vocab: dict[str, int], scores: dict[str, float]) -> list[tuple[str, str]]:
    """SentencePiece keeps scores, not merges: every split of a piece into two pieces of the vocabulary is a
    merge, ranked by the piece's score (higher first), then by the lengths of the two halves (longer first);
    ties keep the order of the vocabulary (as transformers derives them, so both give the same ids)."""
    found = []
    for piece, score in scores.items():
        splits = [(piece[:i], piece[i:]) for i in range(1, len(piece)) if piece[:i] in vocab and piece[i:] in vocab]
        found += [(left, right, score) for left, right in sorted(splits, key=lambda s: (vocab[s[0]], vocab[s[1]]))]
    found.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(left, right) for left, right, _ in found]


BUILDERS = {"gpt2": byte_level, "llama": sentencepiece}  # tokenizer.ggml.model -> builder


def token_of(meta: dict, which: str, tokens: list[str]) -> str | None:
    """The token `tokenizer.ggml.{which}_token_id` names (bos, eos, unknown, padding), or None."""
    index = meta.get(f"tokenizer.ggml.{which}_token_id")
    return tokens[index] if isinstance(index, int) and 0 <= index < len(tokens) else None
