"""Data: documents (corpus), byte-level BPE (tokenizer), token streams and batches (dataset)."""

from qkv.data.corpus import (
    VALIDATION_WORKS,
    Document,
    bundled_documents,
    bundled_split,
    content_hash,
    join,
    read_documents,
    split_documents,
)
from qkv.data.dataset import Batches, Prepared, default_cache_dir, eval_windows, prepare, read_tokens, write_tokens
from qkv.data.tokenizer import EOS, StreamDecoder, Tokenizer

__all__ = [
    "EOS",
    "VALIDATION_WORKS",
    "Batches",
    "Document",
    "Prepared",
    "StreamDecoder",
    "Tokenizer",
    "bundled_documents",
    "bundled_split",
    "content_hash",
    "default_cache_dir",
    "eval_windows",
    "join",
    "prepare",
    "read_documents",
    "read_tokens",
    "split_documents",
    "write_tokens",
]
