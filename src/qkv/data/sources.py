"""Where a run's text comes from: the bundled corpus's fixed split, or the user's files split by fraction."""
from __future__ import annotations

from pathlib import Path

from qkv.config import DataConfig
from qkv.data.corpus import Document, bundled_split, read_documents, split_documents
from qkv.data.dataset import Prepared, default_cache_dir, prepare
from qkv.data.tokenizer import Tokenizer


def split(data: DataConfig) -> tuple[list[Document], list[Document]]:
    """(train, validation) documents for a DataConfig."""
    if not data.paths:
        return bundled_split(data.spelling)
    return split_documents(read_documents(list(data.paths)), data.val_fraction)


def prepare_data(data: DataConfig, cache_dir: Path | None = None, tokenizer: Tokenizer | None = None) -> Prepared:
    """Tokenizer and token files for a DataConfig, from the content-hash cache when present; with
    `tokenizer`, that tokenizer is used instead of training one."""
    train_docs, val_docs = split(data)
    return prepare([d.text for d in train_docs], [d.text for d in val_docs], data.vocab_size,
                   cache_dir or default_cache_dir(), tokenizer)
