"""Hugging Face model dirs on disk: config.json, model.safetensors (or shards with an index), with JSON and
safetensors only (no transformers, no pickle: loading a file never runs code)."""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

from safetensors import SafetensorError
from safetensors.torch import save_file

from qkv.errors import QkvError
from qkv.formats.hf.common import Tensors
from qkv.files import read_json, read_tensors

CONFIG = "config.json"
WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
TOKENIZER = "tokenizer.json"


def is_hf_dir(path: Path) -> bool:
    """A dir whose config.json names a Hugging Face `model_type` or `architectures` (qkv's has sections)."""
    file = Path(path) / CONFIG
    if not file.is_file():
        return False
    try:
        raw = json.loads(file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError):
        return False
    return isinstance(raw, dict) and ("model_type" in raw or "architectures" in raw)


def read_config(path: Path) -> dict:
    raw = read_json(Path(path) / CONFIG)
    if not isinstance(raw, dict):
        raise QkvError(f"{path / CONFIG}: expected a JSON object")
    return raw


def read_weights(path: Path) -> Tensors:
    """model.safetensors, or every shard named by model.safetensors.index.json."""
    path = Path(path)
    if (path / WEIGHTS).is_file():
        return read_tensors(path / WEIGHTS)
    if not (path / INDEX).is_file():
        if any(path.glob("*.bin")):
            raise QkvError(f"{path}: only PyTorch .bin weights (pickle); qkv reads {WEIGHTS} files only")
        raise QkvError(f"{path}: no {WEIGHTS} or {INDEX}")
    index = read_json(path / INDEX)
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict):
        raise QkvError(f"{path / INDEX}: no weight_map")
    tensors: Tensors = {}
    for shard in sorted(set(map(str, weight_map.values()))):
        file = (path / shard).resolve()
        if file.parent != path.resolve() or not shard.endswith(".safetensors"):  # never outside the model dir
            raise QkvError(f"{path / INDEX}: shard {shard!r} is not a .safetensors file in {path}")
        tensors.update(read_tensors(file))
    missing = sorted(set(weight_map) - set(tensors))
    if missing:
        raise QkvError(f"{path / INDEX}: tensor {missing[0]!r} is not in its shard")
    return tensors


def write_dir(out: Path, files: dict[str, str], tensors: Tensors) -> None:
    """Write text `files` and `tensors` (as model.safetensors) into the new dir `out`, atomically: a temp dir
    beside it is renamed into place, so `out` is complete or absent. An existing non-empty `out` is refused."""
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise QkvError(f"{out} already exists and is not empty; choose another directory")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        for name, text in files.items():
            (tmp / name).write_text(text, encoding="utf-8")
        try:
            save_file({k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}, str(tmp / WEIGHTS),
                      metadata={"format": "pt"})  # transformers requires the "pt" format tag
        except SafetensorError as exc:  # a full disk, in safetensors' own error type
            raise QkvError(f"{out}: cannot write {WEIGHTS} ({exc}); nothing was written") from None
        if out.exists():
            out.rmdir()
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def to_json(raw: dict) -> str:
    return json.dumps(raw, indent=2) + "\n"
