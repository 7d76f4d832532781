"""A qkv run dir on disk: config.json, tokenizer.json, model.safetensors (and, while training, its state).

Its layout and readers are `qkv.files`'s; training writes it checkpoint by checkpoint (qkv.train.checkpoint),
and `save` writes one from any loaded Run (`qkv convert ... --out RUN`).
"""
from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

from qkv import files
from qkv.config import RunConfig
from qkv.data.tokenizer import Tokenizer
from qkv.errors import QkvError
from qkv.files import CONFIG_FILE, MODEL_FILE, TOKENIZER_FILE
from qkv.formats.base import Run, check_vocabulary
from qkv.models import build_model
from qkv.models.build import check_model


def detect(path: Path) -> bool:
    return path.is_dir() and (path / CONFIG_FILE).is_file()


def load(path: str | Path, device: str | torch.device = "cpu") -> Run:
    """A qkv run dir: its config, tokenizer and the weights of its last complete checkpoint."""
    path = Path(path)
    if not path.is_dir():
        raise QkvError(f"{path}: no such run directory")
    if not (path / CONFIG_FILE).is_file():
        raise QkvError(f"{path}: not a qkv run (no {CONFIG_FILE})")
    config = RunConfig.load(path / CONFIG_FILE).validate()
    check_model(config.model)  # the model's names: a run is loaded to use its model, not to train it
    model_file = files.committed_file(path, MODEL_FILE)  # reads only: training may be running
    if not model_file.is_file():
        raise QkvError(f"{path}: has no checkpoint yet ({MODEL_FILE} is missing)")
    tokenizer = Tokenizer.load(path / TOKENIZER_FILE)
    check_vocabulary(tokenizer, config.model.vocab_size, path / TOKENIZER_FILE)
    model = build_model(config.model)
    files.load_model_tensors(model, files.read_tensors(model_file), str(model_file))
    return Run(path=path, config=config, model=model.to(device).eval(), tokenizer=tokenizer)


def save(run: Run, out: str | Path, extra: dict[str, str] | None = None) -> Path:
    """Write `run` as a qkv run dir `out` (new or empty), atomically: config.json, tokenizer.json,
    model.safetensors, and the text files of `extra` ({name: text}, e.g. the original HF tokenizer)."""
    out = Path(out)
    if run.tokenizer is None:
        raise QkvError(f"{run.path}: a qkv run needs a tokenizer, and this model came without one "
                       f"(or one without an end-of-text or separator token)")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise QkvError(f"{out} already exists and is not empty; choose another --out")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        run.config.save(tmp / CONFIG_FILE)
        run.tokenizer.save(tmp / TOKENIZER_FILE)
        for name, text in (extra or {}).items():
            (tmp / name).write_text(text, encoding="utf-8")
        save_file(files.model_tensors(run.model), str(tmp / MODEL_FILE))
        if out.exists():
            out.rmdir()
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out
