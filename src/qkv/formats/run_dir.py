"""A qkv run dir on disk: config.json, tokenizer.json, model.safetensors (and, while training, its state).

Its layout and readers are `qkv.files`'s; training writes it checkpoint by checkpoint (qkv.train.checkpoint),
and `save` writes one from any loaded Run (`qkv convert ... --out RUN`).
"""
from __future__ import annotations

import dataclasses
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
from qkv.formats.base import Chat, Run, check_routers, check_vocabulary, model_with
from qkv.formats import chat as model_dir_chat
from qkv.models import build_model
from qkv.models.build import check_model
from qkv.nn.lora import lora_model, merge_lora, parse_spec
from qkv.nn.quant import GROUP, QuantLinear, head_of, quantization_of, quantize_model

CHAT_FILE = "chat.json"  # how a converted model chats (qkv.formats.base.Chat)
QUANT_FILE = "quant.json"  # a run saved with quantized linear layers (qkv convert --quant): {"quant", "group"}


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
    tensors = files.read_tensors(model_file)
    quant = read_quant(path)
    if quant is None and not config.train.lora:  # the file's tensors become the weights
        model = model_with(config.model, tensors, str(model_file))
    else:
        model = build_model(config.model)
        if quant is not None:  # the saved codes and scales go into layers of their shapes: nothing is requantized
            kind, group, head = quant
            quantize_model(model, kind, group, empty=True, head=head)
            load_quantized(model, tensors, str(model_file))
        if config.train.lora:  # a LoRA run's checkpoint holds the frozen layers and their adapters: merged here
            lora_model(model, parse_spec(config.train.lora), empty=True)
            load_quantized(model, tensors, str(model_file))  # QLoRA's frozen codes
        files.load_model_tensors(model, tensors, str(model_file))
        check_routers(model, str(model_file))
    if merge_lora(model):
        config = dataclasses.replace(config, train=dataclasses.replace(config.train, lora=""))  # what it now is
    return Run(path=path, config=config, model=model.to(device).eval(), tokenizer=tokenizer,
               chat=read_chat(path, tokenizer.vocab_size))


def config(path: str | Path) -> RunConfig:
    """The Run's config alone, as `load` gives it (a LoRA run's says lora="", as it loads merged)."""
    path = Path(path)
    if not (path / CONFIG_FILE).is_file():
        raise QkvError(f"{path}: not a qkv run (no {CONFIG_FILE})")
    config = RunConfig.load(path / CONFIG_FILE).validate()
    check_model(config.model)
    if config.train.lora:
        config = dataclasses.replace(config, train=dataclasses.replace(config.train, lora=""))
    return config


def read_quant(path: Path) -> tuple[str, int, str] | None:
    """(quant, group, head kind) of a run saved quantized, None for one that is not."""
    file = path / QUANT_FILE
    if not file.is_file():
        return None
    raw = files.read_json(file)
    quant, group, head = (raw.get("quant"), raw.get("group"), raw.get("head")) if isinstance(raw, dict) else (None,) * 3
    if quant not in ("int8", "int4") or not isinstance(group, int) or isinstance(group, bool) or group <= 0 \
            or group % 2 or head not in ("int8", "bf16"):
        raise QkvError(f"{file}: must be an object with quant (int8 or int4), group (a positive even integer) and "
                       "head (int8 or bf16)")
    return quant, group, head


def load_quantized(model, tensors: dict[str, torch.Tensor], origin: str) -> None:
    """Copy the saved codes, scales and minima into the model's QuantLinear layers, each checked for its dtype
    and shape (an integer tensor is never cast)."""
    for name, buffer in model.named_buffers():
        if name.rpartition(".")[2] not in ("codes", "scale", "low"):
            continue
        value = tensors.get(name)
        if value is None:
            raise QkvError(f"{origin}: missing tensor {name!r}; the file does not match {QUANT_FILE}")
        if value.dtype != buffer.dtype or tuple(value.shape) != tuple(buffer.shape):
            raise QkvError(f"{origin}: {name} is {str(value.dtype).replace('torch.', '')} {tuple(value.shape)}, "
                           f"{QUANT_FILE} needs {str(buffer.dtype).replace('torch.', '')} {tuple(buffer.shape)}")
        buffer.copy_(value)


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


def save_chat(path: Path, chat: Chat) -> None:
    """chat.json, for a model that chats its own way (nothing for qkv's default)."""
    if chat != Chat():
        (path / CHAT_FILE).write_text(json.dumps({"template": chat.template, "bos_token": chat.bos_token,
                                                  "stop_ids": list(chat.stop_ids)}, indent=1), encoding="utf-8")


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
        save_chat(tmp, run.chat)
        for name, text in (extra or {}).items():
            (tmp / name).write_text(text, encoding="utf-8")
        save_file(files.model_tensors(run.model), str(tmp / MODEL_FILE))
        quant = quantization_of(run.model)
        if quant == "gguf":
            raise QkvError("this model holds a GGUF file's blocks as shipped, which a run dir does not keep; load "
                           "the file with --quant none, int8 or int4 to save it")
        if quant != "none":
            groups = [m.group for m in run.model.modules() if isinstance(m, QuantLinear) and m.kind == "int4"]
            (tmp / QUANT_FILE).write_text(json.dumps({"quant": quant, "group": groups[0] if groups else GROUP,
                                                      "head": head_of(run.model)}), encoding="utf-8")
        if out.exists():
            out.rmdir()
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out
