"""What every file format gives and takes: a `Run` (model, tokenizer, config), and the `Format` record of the
`FORMATS` registry that `qkv.formats.load` asks in turn.

    detect(path) -> bool             cheap: a look at names and headers, never the weights
    load(path, device) -> Run        the model in eval mode on `device`
    save(run, out, **options) -> Path   writes `out` (new, or an empty dir) from a Run; nothing existing is lost
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from torch import nn

from qkv.config import RunConfig
from qkv.data.tokenizer import Tokenizer
from qkv.errors import QkvError
from qkv.registry import Registry


@dataclass
class Run:
    path: Path
    config: RunConfig
    model: nn.Module
    tokenizer: Tokenizer | None


@dataclass(frozen=True)
class Format:
    detect: Callable[[Path], bool]
    load: Callable[..., Run]  # (path, device="cpu") -> Run
    save: Callable[..., Path]  # (run, out) -> out
    describe: str  # what it reads, for the error that lists the formats


FORMATS: Registry[Format] = Registry("file format")


def check_vocabulary(tokenizer: Tokenizer | None, vocab_size: int, origin: Path) -> None:
    """A tokenizer whose ids the model has no rows for would fail mid-way (an index error in the embedding)."""
    if tokenizer is not None and tokenizer.vocab_size > vocab_size:
        raise QkvError(f"{origin}: {tokenizer.vocab_size} tokens, more than the model's vocab_size={vocab_size}")
