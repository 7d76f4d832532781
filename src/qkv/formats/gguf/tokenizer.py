"""The tokenizer a GGUF file describes in its metadata (`tokenizer.ggml.*`), built with Hugging Face
`tokenizers` the way transformers' GGUF loader builds it, so both give the same ids:

    model "gpt2": byte-level BPE: `tokens` (in the byte alphabet; any other spelling is mapped to it) with
                  `merges`; the pre-tokenizer splits as the vocabulary was trained (`pre`: GPT-2's regex, or
                  Qwen2's / Llama 3's split before the byte mapping); tokens typed CONTROL (3) are special
                  tokens, USER_DEFINED (4) added tokens, both matched whole.

The end-of-text token qkv needs (`<|endoftext|>`) is the file's own when it has one, else its EOS token
respelled, as for Hugging Face dirs (qkv.formats.hf.tokenizer, docs/DEVIATIONS.md).
"""
from __future__ import annotations

import json

import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers

from qkv.data.tokenizer import EOS, Tokenizer, bytes_to_unicode
from qkv.errors import QkvError
from qkv.formats.hf.tokenizer import respell, spells

CONTROL, USER_DEFINED = 3, 4
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
               r"|\s+(?!\S)|\s+")
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
SPLITS = {"qwen2": QWEN2_SPLIT, "deepseek-r1-qwen": QWEN2_SPLIT, "llama3": LLAMA3_SPLIT, "llama-v3": LLAMA3_SPLIT,
          "llama-bpe": LLAMA3_SPLIT, "smaug-bpe": LLAMA3_SPLIT, "dbrx": LLAMA3_SPLIT}  # tokenizer.ggml.pre


def gguf_tokenizer(meta: dict, origin: str) -> Tokenizer:
    kind = meta.get("tokenizer.ggml.model")
    if kind is None or "tokenizer.ggml.tokens" not in meta:
        raise QkvError(f"{origin}: has no tokenizer (no tokenizer.ggml.model / tokenizer.ggml.tokens)")
    if kind != "gpt2":
        raise QkvError(f"{origin}: tokenizer.ggml.model={kind!r} is not supported; qkv reads byte-level BPE "
                       f"vocabularies ('gpt2': GPT-2, SmolLM, Qwen2, Llama 3)")
    tokens, merges = list(meta["tokenizer.ggml.tokens"]), list(meta.get("tokenizer.ggml.merges", []))
    types = list(meta.get("tokenizer.ggml.token_type", [1] * len(tokens)))
    if len(types) != len(tokens) or not all(isinstance(t, str) for t in tokens):
        raise QkvError(f"{origin}: tokenizer.ggml.token_type has {len(types)} entries for {len(tokens)} tokens")
    table = bytes_to_unicode()
    alphabet = set(table.values())
    vocab = {}
    for index, token in enumerate(tokens):
        spelled = token if set(token) <= alphabet else "".join(table[b] for b in token.encode("utf-8"))
        vocab.setdefault(spelled, index)
    try:
        pairs = [tuple(merge.split(" ")) for merge in merges]
        hf = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=pairs))
    except Exception as exc:  # tokenizers raises plain Exception on a merge of unknown tokens
        raise QkvError(f"{origin}: the tokenizer's merges do not fit its vocabulary ({str(exc)[:100]})") from None
    split = SPLITS.get(meta.get("tokenizer.ggml.pre"))
    hf.pre_tokenizer = (pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True) if split is None else
                        pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(split), behavior="isolated"),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]))
    hf.decoder = decoders.ByteLevel()
    hf.add_special_tokens([AddedToken(t, special=True, normalized=False) for t, kind_ in zip(tokens, types)
                           if kind_ == CONTROL and set(t) <= alphabet])
    hf.add_tokens([AddedToken(t, special=False, normalized=False) for t, kind_ in zip(tokens, types)
                   if kind_ == USER_DEFINED and t in vocab])
    raw = json.loads(hf.to_str())
    if not spells(raw, EOS):
        eos = token_of(meta, "eos", tokens)
        if eos is None or not spells(raw, eos):
            raise QkvError(f"{origin}: the tokenizer has no {EOS} token and no special EOS token to stand for it")
        raw = respell(raw, eos, EOS)
    return Tokenizer.from_str(json.dumps(raw, ensure_ascii=False), source=origin)


def token_of(meta: dict, which: str, tokens: list[str]) -> str | None:
    """The token `tokenizer.ggml.{which}_token_id` names (bos, eos, padding), or None."""
    index = meta.get(f"tokenizer.ggml.{which}_token_id")
    return tokens[index] if isinstance(index, int) and 0 <= index < len(tokens) else None
