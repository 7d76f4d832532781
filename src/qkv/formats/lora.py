"""A LoRA adapter as both of its files say it (a PEFT dir: qkv.formats.peft; a GGUF adapter: qkv.formats.gguf.adapter),
in one form, and put over a model by the one layer-swap mechanism (qkv.nn.swap, as `qkv train --lora` does).

    adapter = qkv.formats.read_adapter(path, cfg)   # a PEFT dir or a GGUF adapter file, checked against cfg
    apply_adapter(model, adapter)                   # a LoRALinear over each adapted layer; merge_lora folds it in

An Adapter holds, for each adapted linear layer (by qkv's module name, `blocks.3.attn.q_proj`), A (r, K), B (N, r)
and the scaling s with which the layer computes W x + s B A x. The files say s differently: PEFT once for all
layers, s = alpha / r (alpha / sqrt(r) with rsLoRA); a GGUF adapter says alpha once and llama.cpp takes
s = alpha / r with r each pair's own rank (B's columns). Names between qkv and the files go through the Hugging
Face family's export rules (`hf_modules`), so an adapter is written for the families whose linear layers HF
keeps as modules of their own (LLaMA, Qwen2/3, Mistral, SmolLM3, Gemma).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from qkv.config import ModelConfig
from qkv.errors import QkvError
from qkv.formats.hf import exporter
from qkv.models import build_model
from qkv.nn.lora import LoRALinear, LoraSpec
from qkv.nn.quant import QuantLinear
from qkv.nn.swap import swap


@dataclass(frozen=True)
class LoraPair:
    A: Tensor  # (r, K)
    B: Tensor  # (N, r)
    scaling: float

    @property
    def rank(self) -> int:
        return self.A.shape[0]


@dataclass(frozen=True)
class Adapter:
    layers: dict[str, LoraPair]  # qkv module name -> its pair
    origin: str  # the file or dir it came from, for messages
    spec: LoraSpec | None = None  # PEFT's settings where the file has them (targets, dropout, rsLoRA)

    def describe(self) -> str:
        ranks = sorted({pair.rank for pair in self.layers.values()})
        scalings = sorted({round(pair.scaling, 6) for pair in self.layers.values()})
        return f"r={'/'.join(map(str, ranks))}, scaling={'/'.join(f'{s:g}' for s in scalings)}"


def hf_modules(cfg: ModelConfig) -> dict[str, str]:
    """qkv module name -> HF module name, for every linear layer the family exports by a plain rename."""
    with torch.device("meta"):
        model = build_model(cfg)
    tensors = dict(model.named_parameters())
    hf = exporter(cfg).to_hf(tensors, cfg)
    by_id = {id(tensor): name for name, tensor in hf.items()}
    return {name.removesuffix(".weight"): by_id[id(tensor)].removesuffix(".weight")
            for name, tensor in tensors.items() if name.endswith(".weight") and id(tensor) in by_id}


def linear_shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """qkv module name -> (in, out) of every linear layer inside the blocks (what an adapter may adapt)."""
    with torch.device("meta"):
        model = build_model(cfg)
    return {name: (module.in_features, module.out_features) for name, module in model.named_modules()
            if isinstance(module, nn.Linear) and name.startswith("blocks.")}


def check_adapter(adapter: Adapter, cfg: ModelConfig) -> Adapter:
    """Every pair lands on a linear layer of the blocks with its shapes and a positive rank: else one line
    naming the first that does not fit (an adapter made for another base)."""
    if not adapter.layers:
        raise QkvError(f"{adapter.origin}: holds no LoRA pair")
    shapes = linear_shapes(cfg)
    for name, pair in adapter.layers.items():
        if name not in shapes:
            raise QkvError(f"{adapter.origin}: adapts {name}, which is no linear layer of this model's blocks "
                           "(an adapter for another base?)")
        (k, n), (r, a_in), (b_out, r_b) = shapes[name], tuple(pair.A.shape), tuple(pair.B.shape)
        if r < 1 or r_b != r:
            raise QkvError(f"{adapter.origin}: {name} has lora_a {tuple(pair.A.shape)} and lora_b "
                           f"{tuple(pair.B.shape)}: the rank must be positive and the same in both")
        if (a_in, b_out) != (k, n):
            raise QkvError(f"{adapter.origin}: {name} maps {a_in} -> {b_out} features, this model's {k} -> {n} "
                           "(an adapter for another base?)")
        if not (torch.isfinite(pair.A).all() and torch.isfinite(pair.B).all()):
            raise QkvError(f"{adapter.origin}: {name} holds a NaN or infinite number")
        if not (pair.scaling > 0 and math.isfinite(pair.scaling)):
            raise QkvError(f"{adapter.origin}: {name}'s scaling {pair.scaling} must be a positive number")
    return adapter


def apply_adapter(model: nn.Module, adapter: Adapter) -> int:
    """Freeze `model` and put a LoRALinear holding the adapter's pair over each adapted layer (its rank and
    scaling its own); the number of layers adapted. `adapter` was checked against the model's config."""
    for param in model.parameters():
        param.requires_grad_(False)
    modules = dict(model.named_modules())
    specs = {}
    for name, pair in adapter.layers.items():
        module = modules.get(name)
        if not isinstance(module, (nn.Linear, QuantLinear)):
            raise QkvError(f"{adapter.origin}: adapts {name}, which is no linear layer of this model")
        specs[id(module)] = (name, LoraSpec(r=pair.rank, alpha=pair.scaling * pair.rank, dropout=0.0))

    def make(module: nn.Module) -> nn.Module:
        name, spec = specs[id(module)]
        layer = LoRALinear(module, spec)
        layer.scaling = adapter.layers[name].scaling  # exactly the file's (alpha * r / r may round)
        with torch.no_grad():
            layer.lora_A.weight.copy_(adapter.layers[name].A)
            layer.lora_B.weight.copy_(adapter.layers[name].B)
        held = next(iter([*module.parameters(), *module.buffers()]), None)
        return layer.to(held.device) if held is not None else layer

    return len(swap(model, lambda name, module: id(module) in specs and name in adapter.layers, make))
