"""A run dir on disk: config.json, tokenizer.json, model.safetensors (and training state)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from qkv import files
from qkv.config import RunConfig
from qkv.data.tokenizer import Tokenizer
from qkv.errors import QkvError
from qkv.files import CONFIG_FILE, TOKENIZER_FILE
from qkv.models import build_model
from qkv.models.build import check_model


@dataclass
class Run:
    path: Path
    config: RunConfig
    model: nn.Module
    tokenizer: Tokenizer


def load(path: str | Path, device: str | torch.device = "cpu") -> Run:
    """Load a qkv run dir: its config, tokenizer and the weights of its last complete checkpoint.
    A Hugging Face model dir (config.json with "model_type" or "architectures") is read by qkv.hf.load."""
    path = Path(path)
    if not path.is_dir():
        raise QkvError(f"{path}: no such run directory")
    from qkv.hf.files import is_hf_dir  # JSON only; qkv.hf itself imports this module

    if is_hf_dir(path):
        from qkv import hf

        return hf.load(path, device)
    if not (path / CONFIG_FILE).is_file():
        raise QkvError(f"{path}: not a qkv run (no {CONFIG_FILE})")
    config = RunConfig.load(path / CONFIG_FILE).validate()
    check_model(config.model)  # the model's names: a run is loaded to use its model, not to train it
    model_file = files.committed_file(path, files.MODEL_FILE)  # reads only: training may be running
    if not model_file.is_file():
        raise QkvError(f"{path}: has no checkpoint yet ({files.MODEL_FILE} is missing)")
    tokenizer = Tokenizer.load(path / TOKENIZER_FILE)
    check_vocabulary(tokenizer, config.model.vocab_size, path / TOKENIZER_FILE)
    model = build_model(config.model)
    tensors = files.read_tensors(model_file)
    files.load_model_tensors(model, tensors, str(model_file))
    return Run(path=path, config=config, model=model.to(device).eval(), tokenizer=tokenizer)


def check_vocabulary(tokenizer: Tokenizer | None, vocab_size: int, origin: Path) -> None:
    """A tokenizer whose ids the model has no rows for would fail mid-way (an index error in the embedding)."""
    if tokenizer is not None and tokenizer.vocab_size > vocab_size:
        raise QkvError(f"{origin}: {tokenizer.vocab_size} tokens, more than the model's vocab_size={vocab_size}")
