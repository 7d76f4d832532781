"""LoRA adapters in PEFT's format: a dir with adapter_config.json and adapter_model.safetensors, which
`peft.PeftModel.from_pretrained(transformers_model, dir)` loads onto the Hugging Face model qkv exports
(qkv.formats.hf), and which qkv reads (`read_adapter`) to put over its own model (`--adapter DIR`: qkv.formats.merge_adapter).

Names: qkv's `blocks.3.attn.q_proj` is the HF module `model.layers.3.self_attn.q_proj`, found through the
family's own export rules (a module whose weight is renamed, not transposed or joined: LLaMA, Qwen2); its
adapter tensors are `base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight` (r, K) and `...lora_B.weight`
(N, r), as PEFT writes them. adapter_config.json holds PEFT's LoraConfig fields; qkv reads r, lora_alpha,
lora_dropout, target_modules and use_rslora, and refuses the options it does not implement (DoRA, biases,
modules_to_save, per-layer ranks) rather than ignore them.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from qkv import files
from qkv.config import ModelConfig
from qkv.errors import QkvError
from qkv.formats.lora import Adapter, LoraPair, check_adapter, hf_modules
from qkv.models import build_model
from qkv.nn.lora import ALL_LINEAR, TARGETS, LoraSpec, adapters, check_spec, is_target

CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"
PREFIX = "base_model.model."
UNSUPPORTED = {"use_dora": False, "fan_in_fan_out": False, "modules_to_save": None, "layers_to_transform": None,
               "rank_pattern": {}, "alpha_pattern": {}, "bias": "none", "target_parameters": None}


def save_adapter(model: nn.Module, cfg: ModelConfig, spec: LoraSpec, out: str | Path) -> Path:
    """Write the adapters of `model` into `out` (created if needed; these two files replaced atomically)."""
    layers = {name: LoraPair(A=layer.lora_A.weight, B=layer.lora_B.weight, scaling=layer.scaling)
              for name, layer in adapters(model).items()}
    if not layers:
        raise QkvError("the model has no LoRA adapters to save")
    return write_adapter(Adapter(layers=layers, origin="the model", spec=spec), cfg, out)


def write_adapter(adapter: Adapter, cfg: ModelConfig, out: str | Path) -> Path:
    """`adapter` as a PEFT dir `out` (created if needed; its two files replaced atomically). PEFT says one rank and
    one alpha: an adapter read from elsewhere (a GGUF file) must have one rank and one scaling s, written as
    lora_alpha = s r."""
    out = Path(out)
    names = hf_modules(cfg)
    tensors = {}
    for name, pair in adapter.layers.items():
        hf = names.get(name)
        if hf is None:
            raise QkvError(f"{name}: this model's Hugging Face layout has no module of its own for it (PEFT adapters "
                           "are written for the LLaMA and Qwen2 families)")
        tensors[f"{PREFIX}{hf}.lora_A.weight"] = pair.A.detach().float().cpu().contiguous()
        tensors[f"{PREFIX}{hf}.lora_B.weight"] = pair.B.detach().float().cpu().contiguous()
    spec = adapter.spec
    if spec is None:
        ranks = {pair.rank for pair in adapter.layers.values()}
        scalings = {pair.scaling for pair in adapter.layers.values()}
        if len(ranks) != 1 or max(scalings) - min(scalings) > 1e-6 * max(scalings):
            raise QkvError(f"{adapter.origin}: its pairs have ranks {sorted(ranks)} and scalings {sorted(scalings)}; "
                           "a PEFT dir says one rank and one alpha")
        r = ranks.pop()
        spec = LoraSpec(r=r, alpha=float(scalings.pop() * r), dropout=0.0)
    targets = sorted({key[len(PREFIX):].rsplit(".", 2)[0].rpartition(".")[2] for key in tensors})
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": spec.r, "lora_alpha": spec.alpha,
              "lora_dropout": spec.dropout, "target_modules": targets, "use_rslora": spec.rslora,
              "init_lora_weights": True, "inference_mode": True, "base_model_name_or_path": None, "revision": None,
              **UNSUPPORTED}
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / (WEIGHTS + ".tmp")), metadata={"format": "pt"})
    (out / (CONFIG + ".tmp")).write_text(json.dumps(config, indent=2), encoding="utf-8")
    os.replace(out / (WEIGHTS + ".tmp"), out / WEIGHTS)
    os.replace(out / (CONFIG + ".tmp"), out / CONFIG)
    return out


def read_spec(path: Path) -> LoraSpec:
    file = path / CONFIG
    if not file.is_file():
        raise QkvError(f"{path}: not a PEFT adapter (no {CONFIG})")
    raw = files.read_json(file)
    if not isinstance(raw, dict) or raw.get("peft_type") != "LORA":
        raise QkvError(f"{file}: peft_type must be \"LORA\" (qkv reads LoRA adapters)")
    for key, plain in UNSUPPORTED.items():
        if raw.get(key, plain) not in (plain, None, {}, False, "none"):
            raise QkvError(f"{file}: {key}={json.dumps(raw[key])[:60]} is not supported by qkv (only {plain!r})")
    targets = raw.get("target_modules")
    if targets == ALL_LINEAR:
        targets = [ALL_LINEAR]
    short = {hf: short for short, hf in TARGETS.items()}
    if not isinstance(targets, list) or not all(t in short or t == ALL_LINEAR for t in targets):
        raise QkvError(f"{file}: target_modules={json.dumps(targets)[:80]}; qkv reads a list of "
                       f"{', '.join(TARGETS.values())} or \"all-linear\"")
    r, alpha, dropout = raw.get("r"), raw.get("lora_alpha"), raw.get("lora_dropout", 0.0)
    if not isinstance(r, int) or not isinstance(alpha, (int, float)) or not isinstance(dropout, (int, float)):
        raise QkvError(f"{file}: r must be an integer, lora_alpha and lora_dropout numbers")
    spec = LoraSpec(r=r, alpha=float(alpha), dropout=float(dropout), rslora=bool(raw.get("use_rslora", False)),
                    targets=tuple(short.get(t, t) for t in targets))
    check_spec(spec)
    return spec


def read_adapter(path: str | Path, cfg: ModelConfig) -> Adapter:
    """The PEFT dir `path` as an Adapter for a model of `cfg`: one pair on every layer its target_modules pick
    (qkv.nn.lora.is_target), each tensor on a layer, with the shapes of that layer (qkv.formats.lora)."""
    path = Path(path)
    spec = read_spec(path)
    if not (path / WEIGHTS).is_file():
        raise QkvError(f"{path}: no {WEIGHTS}")
    tensors = files.read_tensors(path / WEIGHTS)
    names = hf_modules(cfg)
    with torch.device("meta"):
        model = build_model(cfg)
    targets = [name for name, module in model.named_modules() if is_target(name, module, spec)]
    if not targets:
        raise QkvError(f"{path / CONFIG}: target_modules={','.join(spec.targets)}: no such linear layer in this "
                       "model's blocks")
    layers, found = {}, set()
    for name in targets:
        keys = [f"{PREFIX}{names.get(name, name)}.{part}.weight" for part in ("lora_A", "lora_B")]
        missing = [key for key in keys if key not in tensors]
        if missing:
            raise QkvError(f"{path / WEIGHTS}: no tensor {missing[0]!r} for the target layer {name}")
        layers[name] = LoraPair(A=tensors[keys[0]].float(), B=tensors[keys[1]].float(), scaling=spec.scaling)
        found.update(keys)
    extra = sorted(set(tensors) - found)
    if extra:
        raise QkvError(f"{path / WEIGHTS}: tensors for no layer of this model: {', '.join(extra[:3])}")
    return check_adapter(Adapter(layers=layers, origin=str(path / WEIGHTS), spec=spec), cfg)
