"""File formats: every kind of file a model comes in or goes out as, behind one `load(path)`.

    run = qkv.formats.load(path)         # (qkv.load) a qkv run dir, a Hugging Face model dir or a GGUF file -> Run
    cfg = qkv.formats.load_config(path)  # its RunConfig alone, weights unread
    qkv.formats.save(run, out, "gguf")   # write it in a format: "run" (a qkv run dir), "hf" or "gguf"
    adapter = qkv.formats.read_adapter(path, cfg.model)   # a LoRA adapter: a PEFT dir or a GGUF adapter file
    qkv.formats.merge_adapter(run, path)                  # ... put over run.model and folded into its weights

Each format is an entry of `FORMATS` (qkv.formats.base.Format: detect, load, save), registered here, where
the package is assembled; `load` asks each entry's `detect` in the order below (an HF dir also has a
config.json, so it is asked first). `qkv.formats.params` moves parameters between the two engines (a torch
state dict and the reference engine's NumPy dict, the same keys).
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch
from torch import nn

from qkv.config import ModelConfig, RunConfig
from qkv.errors import QkvError
from qkv.formats import gguf, hf, peft, run_dir
from qkv.formats.base import FORMATS, Format, Run
from qkv.formats.gguf import adapter as gguf_adapter
from qkv.formats.lora import Adapter, apply_adapter
from qkv.nn.lora import merge_lora

__all__ = ["FORMATS", "Adapter", "Format", "Run", "load", "load_config", "merge_adapter", "read_adapter", "save"]

FORMATS.register("gguf")(Format(detect=gguf.detect, load=gguf.load, save=gguf.save, config=gguf.config, streams=True,
                                describe="a GGUF file (llama.cpp: llama or gpt2, byte-level BPE tokenizer)"))
FORMATS.register("hf")(Format(detect=hf.is_hf_dir, load=hf.load, save=hf.save, config=hf.config,
                              describe="a Hugging Face model dir (config.json with model_type or architectures)"))
FORMATS.register("run")(Format(detect=run_dir.detect, load=run_dir.load, save=run_dir.save, config=run_dir.config,
                               describe="a qkv run dir (config.json, tokenizer.json, model.safetensors)"))
ORDER = ("gguf", "hf", "run")  # the first whose detect says yes reads the path


def load(path: str | Path, device: str | torch.device = "cpu", *,
         convert: Callable[[nn.Module], None] | None = None, shipped: bool = False) -> Run:
    """Read a model from any format qkv knows: its model (eval mode, on `device`), tokenizer and config.
    `convert(block)`, where the format streams (GGUF), runs on each block as soon as its weights are read
    (qkv.generate.weights.convert_block: a quantized model never holds all its weights in fp32 at once);
    elsewhere it is not called, and the caller's prepare converts the whole model after loading. `shipped`:
    a GGUF file's quantized blocks kept as they are (qkv.formats.gguf.load); nothing elsewhere."""
    path = Path(path)
    if not path.exists():
        raise QkvError(f"{path}: no such run directory or model file")
    for name in ORDER:
        entry = FORMATS.get(name)
        if entry.detect(path):
            if entry.streams and (convert is not None or shipped):
                return entry.load(path, device, convert=convert, shipped=shipped)
            return entry.load(path, device)
    if path.is_dir():
        return run_dir.load(path, device)  # names what a run dir lacks
    kinds = "; ".join(FORMATS.get(name).describe for name in ORDER)
    raise QkvError(f"{path}: not a model qkv can read; it reads {kinds}")


def load_config(path: str | Path) -> RunConfig:
    """What `load(path).config` is, from the format's metadata alone where it can (no weights read)."""
    path = Path(path)
    for name in ORDER:
        entry = FORMATS.get(name)
        if path.exists() and entry.detect(path) and entry.config is not None:
            return entry.config(path)
    return load(path).config  # names what is wrong with the path


def save(run: Run, out: str | Path, format: str) -> Path:
    """Write `run` to `out` in `format` (a name of FORMATS that writes)."""
    entry = FORMATS.get(format)
    if entry.save is None:
        writers = ", ".join(name for name in FORMATS.names() if FORMATS.get(name).save is not None)
        raise QkvError(f"qkv reads the {format} format but does not write it; it writes: {writers}")
    return entry.save(run, out)


def read_adapter(path: str | Path, cfg: ModelConfig, base: str | Path | None = None) -> Adapter:
    """A LoRA adapter for a model of `cfg`: a PEFT dir (qkv.formats.peft; a LoRA run dir is one) or a GGUF
    adapter file (qkv.formats.gguf.adapter), checked to fit the model (qkv.formats.lora.check_adapter). `base`:
    the base model's path, whose file names the architecture a GGUF adapter must be for."""
    path = Path(path)
    if path.is_dir():
        return peft.read_adapter(path, cfg)
    if path.is_file() and gguf.is_gguf(path):
        return gguf_adapter.read_adapter(path, cfg, gguf_adapter.base_file_arch(base) if base else None)
    if not path.exists():
        raise QkvError(f"{path}: no such adapter dir or file")
    raise QkvError(f"{path}: not a LoRA adapter: a PEFT dir ({peft.CONFIG} + {peft.WEIGHTS}) or a GGUF adapter file")


def merge_adapter(run: Run, path: str | Path) -> str:
    """Put the LoRA adapter at `path` over run.model and fold it into the weights (W + s B A, qkv.nn.lora's
    merge_lora): what `--adapter` does for generate, chat, eval, serve, probe and explain. What was done, in a line."""
    adapter = read_adapter(path, run.config.model, run.path)
    apply_adapter(run.model, adapter)
    merged = merge_lora(run.model)
    return f"qkv: LoRA adapter {path} merged into {merged} layers ({adapter.describe()})"
