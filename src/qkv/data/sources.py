"""Where a run's text comes from: the bundled corpus's fixed split, or the user's files split by fraction."""
from __future__ import annotations

from pathlib import Path
from typing import Callable

from qkv.config import DataConfig
from qkv.data.corpus import Document, bundled_split, read_documents, split_documents
from qkv.data.dataset import Prepared, default_cache_dir, prepare
from qkv.data.tokenizer import Tokenizer
from qkv.registry import Registry
from qkv.data.folio import folio_split as aligned_split
from qkv.data.genres import genre_documents


# data.split: how the bundled corpus is held out; each entry maps a spelling to (train, validation)
SPLITS: Registry[Callable[[str], tuple[list[Document], list[Document]]]] = Registry("data split")
SPLITS.register("standard")(bundled_split)  # corpus.VALIDATION_WORKS


@SPLITS.register("genre")
def genre_split(spelling: str) -> tuple[list[Document], list[Document]]:
    """Every work but the genre task's validation and test plays; validation: its validation plays."""
    return genre_documents(spelling)


@SPLITS.register("folio")
def folio_split(spelling: str) -> tuple[list[Document], list[Document]]:
    """The 35 works in both spellings as aligned "modern<TAB>Folio" lines (qkv.data.folio); validation: the
    Folio twins of corpus.VALIDATION_WORKS. Both spellings are in every line, so data.spelling plays no part."""
    return aligned_split()


def split(data: DataConfig) -> tuple[list[Document], list[Document]]:
    """(train, validation) documents for a DataConfig."""
    if not data.paths:
        return SPLITS.get(data.split)(data.spelling)
    return split_documents(read_documents(list(data.paths)), data.val_fraction)


def prepare_data(data: DataConfig, cache_dir: Path | None = None, tokenizer: Tokenizer | None = None) -> Prepared:
    """Tokenizer and token files for a DataConfig, from the content-hash cache when present; with
    `tokenizer`, that tokenizer is used instead of training one."""
    train_docs, val_docs = split(data)
    return prepare([d.text for d in train_docs], [d.text for d in val_docs], data.vocab_size,
                   cache_dir or default_cache_dir(), tokenizer)
