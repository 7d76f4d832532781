"""Byte-level BPE (GPT-2 style) on Hugging Face `tokenizers`, plus a streaming decoder for generation.

All 256 bytes are in the vocabulary, so every string encodes and decode(encode(s)) == s. The text
"<|endoftext|>" inside user text encodes as ordinary bytes (`encode_special_tokens`); only code that
asks for `eos_id` puts the EOS token into a stream.
"""

from __future__ import annotations

import codecs
import json
import os
from functools import cached_property
from pathlib import Path
from typing import Iterable, Sequence

import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

from qkv.errors import QkvError

EOS = "<|endoftext|>"
MASK = "<|mask|>"  # the MLM objective's [MASK] (qkv.data.mlm); added by `add_specials`, not trained
PAD = "<|pad|>"  # the filler of variable-length batches (qkv.data.seq2seq); added by `add_specials`
MIN_VOCAB = 256 + 1  # the byte alphabet + EOS


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table, the one ByteLevel uses (openai/gpt-2 src/encoder.py)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            table[byte] = chr(byte)
        else:
            table[byte] = chr(256 + extra)
            extra += 1
    return table


class Tokenizer:
    """A trained byte-level BPE tokenizer (wraps `tokenizers.Tokenizer`)."""

    def __init__(self, hf_tokenizer: tokenizers.Tokenizer):
        self._hf = hf_tokenizer
        self._hf.encode_special_tokens = True  # not saved in tokenizer.json, so set on every load
        eos_id = self._hf.token_to_id(EOS)
        if eos_id is None:
            raise QkvError(f"tokenizer has no {EOS} token; train it with qkv")
        self.eos_id: int = eos_id

    @classmethod
    def train(cls, texts: Iterable[str], vocab_size: int) -> Tokenizer:
        """Learn merges from `texts` until `vocab_size` ids (fewer if the text runs out of pairs)."""
        if not isinstance(vocab_size, int) or vocab_size < MIN_VOCAB:
            raise QkvError(f"vocab_size must be an integer >= {MIN_VOCAB} (256 bytes + EOS), got {vocab_size!r}")
        hf = tokenizers.Tokenizer(models.BPE())
        hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        hf.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=[EOS],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        hf.train_from_iterator(texts, trainer)
        return cls(hf)

    def add_specials(self, names: Sequence[str]) -> None:
        """Append special tokens after the trained vocabulary: no existing id changes (the token files
        stay valid) and a token already present keeps its id. They are saved with the tokenizer."""
        self._hf.add_special_tokens(list(names))
        self.__dict__.pop("token_bytes", None)  # drop the cached id -> bytes table

    def special_id(self, name: str) -> int:
        token_id = self._hf.token_to_id(name)
        if token_id is None:
            raise QkvError(f"tokenizer has no {name} token; add it with add_specials")
        return token_id

    @property
    def trained_size(self) -> int:
        """Ids of the trained vocabulary (bytes, merges, EOS); `add_specials` appends after them."""
        return self._hf.get_vocab_size(with_added_tokens=False)

    @property
    def vocab_size(self) -> int:
        return self._hf.get_vocab_size()

    @property
    def bos_ids(self) -> list[int]:
        """[<bos>] where the tokenizer's post-processor puts one before every text (start_id: Gemma's and Llama's
        files ask for it), else []: what a text's ids begin with when a model reads it as written (qkv probe,
        qkv explain), where generation and scoring always put start_id first."""
        return [self.start_id] if self.start_id != self.eos_id else []

    @cached_property
    def start_id(self) -> int:
        """The token a language model's text starts with: the special token the tokenizer's post-processor puts
        first (Gemma's and Llama's <bos>, written there by qkv.formats.gguf.tokenizer or the HF dir's
        tokenizer.json), else the end-of-text token (qkv's own tokenizers, GPT-2, SmolLM2)."""
        processor = json.loads(self._hf.to_str()).get("post_processor") or {}
        processors = processor.get("processors", [processor]) if isinstance(processor, dict) else []
        for step in processors:
            first = (step.get("single") or [None])[0] if step.get("type") == "TemplateProcessing" else None
            if isinstance(first, dict) and "SpecialToken" in first:
                found = self._hf.token_to_id(first["SpecialToken"].get("id", ""))
                if found is not None:
                    return found
        return self.eos_id

    def encode(self, text: str) -> list[int]:
        _check_text(text)
        return self._hf.encode(text, add_special_tokens=False).ids

    def encode_with_specials(self, text: str) -> list[int]:
        """Like `encode`, but the text of an added token (a chat template's "<|im_start|>") is that token."""
        _check_text(text)
        self._hf.encode_special_tokens = False
        try:
            return self._hf.encode(text, add_special_tokens=False).ids
        finally:
            self._hf.encode_special_tokens = True

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """Encodes in parallel (Rust threads); same ids as `encode` on each text."""
        texts = list(texts)
        for text in texts:
            _check_text(text)
        return [e.ids for e in self._hf.encode_batch_fast(texts, add_special_tokens=False)]

    def decode(self, ids: Iterable[int]) -> str:
        """Ids -> text; EOS decodes to its text. Invalid UTF-8 (a cut multi-byte character) becomes U+FFFD."""
        return self._hf.decode([int(i) for i in ids], skip_special_tokens=False)

    @cached_property
    def token_bytes(self) -> TokenBytes:
        """id -> the bytes it stands for (for streaming decode), each worked out when first asked for."""
        return TokenBytes(self)

    def to_str(self) -> str:
        return self._hf.to_str()

    @classmethod
    def from_str(cls, json_text: str, source: str = "tokenizer JSON") -> Tokenizer:
        try:
            return cls(tokenizers.Tokenizer.from_str(json_text))
        except Exception as error:  # tokenizers raises plain Exception on bad JSON
            raise QkvError(f"{source}: not a valid tokenizer file: {str(error).splitlines()[0]}") from None

    def save(self, path: str | os.PathLike) -> None:
        """Writes tokenizer.json-format text to `path`, atomically."""
        path = Path(path)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(self.to_str(), encoding="utf-8")
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: str | os.PathLike) -> Tokenizer:
        try:
            text = Path(path).read_text(encoding="utf-8")
        except FileNotFoundError:
            raise QkvError(f"{path}: tokenizer file not found") from None
        except (OSError, UnicodeDecodeError) as error:
            raise QkvError(f"{path}: cannot read tokenizer: {error}") from None
        return cls.from_str(text, source=str(path))


class TokenBytes(Sequence):
    """The bytes each id stands for: an added or special token its own text; a byte-level BPE token its
    characters mapped back to bytes; a SentencePiece piece ("byte fallback") its text with "▁" as a space, or the
    byte of a <0xNN> token. Worked out per id when first asked for: a stream decodes a few hundred ids, and
    Gemma 3's 262,144 at once took 0.4 s of a chat's start."""

    def __init__(self, tokenizer: Tokenizer):
        self._hf, self._size = tokenizer._hf, tokenizer.vocab_size
        self._added = set(self._hf.get_added_tokens_decoder()) | {tokenizer.eos_id}
        self._pieces = getattr(self._hf.model, "byte_fallback", False)
        self._known: dict[int, bytes] = {}

    def __len__(self) -> int:
        return self._size

    def __getitem__(self, token_id: int) -> bytes:
        if not 0 <= token_id < self._size:
            raise IndexError(token_id)
        data = self._known.get(token_id)
        if data is None:
            data = self._known[token_id] = self._bytes_of(token_id)
        return data

    def _bytes_of(self, token_id: int) -> bytes:
        token = self._hf.id_to_token(token_id)
        if token_id in self._added:
            return token.encode()
        if self._pieces:
            byte = token.startswith("<0x") and token.endswith(">") and len(token) == 6
            return bytes([int(token[3:5], 16)]) if byte else token.replace("\u2581", " ").encode()
        return bytes(BYTE_OF[char] for char in token)


BYTE_OF = {char: byte for byte, char in bytes_to_unicode().items()}  # byte-level BPE's character -> its byte


def _check_text(text: str) -> None:
    if not isinstance(text, str):
        raise TypeError(f"expected str, got {type(text).__name__}")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise QkvError(f"text is not valid Unicode: lone surrogate at character {error.start}") from None


class StreamDecoder:
    """Decodes ids one at a time; holds back bytes of a character that is not complete yet.

    "".join(push(i) for i in ids) + flush() == tokenizer.decode(ids) for ids from `encode` (a SentencePiece
    vocabulary aside: its first "▁", the space it puts before the text, is streamed, and decode strips it).
    Ids outside the vocabulary decode to nothing, as in `Tokenizer.decode`.
    """

    def __init__(self, tokenizer: Tokenizer):
        self._bytes = tokenizer.token_bytes
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        token_id = int(token_id)
        data = self._bytes[token_id] if 0 <= token_id < len(self._bytes) else b""
        return self._utf8.decode(data)

    def flush(self) -> str:
        """Whatever is held back (an incomplete character becomes U+FFFD); the decoder is then empty."""
        return self._utf8.decode(b"", final=True)


def needs_tokenizer(tokenizer: Tokenizer | None, name: str) -> Tokenizer:
    if tokenizer is None:
        raise QkvError(f"objective {name!r} needs the run's tokenizer for its special tokens")
    return tokenizer
