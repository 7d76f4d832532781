"""A qkv run dir on disk: config.json, tokenizer.json, model.safetensors (and, while training, its state).

Its layout and readers are `qkv.files`'s; training writes it checkpoint by checkpoint (qkv.train.checkpoint),
and `save` writes one from any loaded Run (`qkv convert ... --out RUN`).
"""
from __future__ import annotations

import json
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
from qkv.formats.base import Chat, Run, check_vocabulary
from qkv.formats import chat as model_dir_chat
from qkv.models import build_model
from qkv.models.build import check_model

CHAT_FILE = "chat.json"  # how a converted model chats (qkv.formats.base.Chat)


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
    return Run(path=path, config=config, model=model.to(device).eval(), tokenizer=tokenizer,
               chat=read_chat(path, tokenizer.vocab_size))


def read_chat(path: Path, vocab_size: int) -> Chat:
    """A converted model's chat (chat.json: its template, BOS text and turn-ending ids), else one given the
    way an HF dir gives it (a tokenizer_config.json or chat_template.jinja put in the run dir), else none."""
    file = path / CHAT_FILE
    if not file.is_file():
        return model_dir_chat.read_chat(path, {}, vocab_size)
    raw = files.read_json(file)
    raw = raw if isinstance(raw, dict) else {}
    template, bos, stops = raw.get("template"), raw.get("bos_token"), raw.get("stop_ids")
    if not (template is None or isinstance(template, str)) or not isinstance(bos, str) or not isinstance(stops, list) \
            or not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < vocab_size for i in stops):
        raise QkvError(f"{file}: must be an object with template (text or null), bos_token (text) and stop_ids "
                       f"(token ids below {vocab_size})")
    return Chat(template=template, bos_token=bos, stop_ids=tuple(stops))


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
        if run.chat != Chat():
            (tmp / CHAT_FILE).write_text(json.dumps({"template": run.chat.template, "bos_token": run.chat.bos_token,
                                                     "stop_ids": list(run.chat.stop_ids)}, indent=1), encoding="utf-8")
        for name, text in (extra or {}).items():
            (tmp / name).write_text(text, encoding="utf-8")
        save_file(files.model_tensors(run.model), str(tmp / MODEL_FILE))
        if out.exists():
            out.rmdir()
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out
