"""LoRA (Hu et al. 2021): a frozen linear layer plus a trained low-rank update, swapped into a finished model
from outside (qkv.nn.swap), as PEFT does.

    h = W x + b + s B A drop(x),    s = alpha / r   (rsLoRA: s = alpha / sqrt(r))
    A (r, K): Kaiming-uniform (PEFT's default),  B (N, r): zeros  -> the adapted model starts as the model itself

Only A and B train: r (K + N) numbers a layer instead of N K. The backward of the update (autograd computes it;
written out for the docs), with g = dL/dh and u = A drop(x):

    dL/dB = s g u^T,    dL/dA = s (B^T g) drop(x)^T,    dL/dx = W^T g + s drop'(A^T B^T g)

and W gets no gradient (frozen). Merging folds the update into the weight: W' = W + s B A, the same function up
to float rounding (qkv convert RUN --merge-lora). With QLoRA the frozen base is a QuantLinear (int8 or 4-bit,
qkv.nn.quant), whose backward to x uses its dequantized weight; the adapters stay in fp32.

The spec, as `qkv train --lora` takes it: r=16,alpha=32,dropout=0.05,targets=q,k,v,o,gate,up,down (or
targets=all-linear: every linear layer of the blocks; the head is never a target).
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Iterator

import torch
from torch import Tensor, nn

from qkv.errors import QkvError
from qkv.nn.quant import QUANTS, QuantLinear, quantizable
from qkv.nn.swap import swap

# the spec's short names -> the last part of qkv's module names (also PEFT's / HF's names for LLaMA and Qwen2)
TARGETS = {"q": "q_proj", "k": "k_proj", "v": "v_proj", "o": "o_proj", "gate": "gate_proj", "up": "up_proj",
           "down": "down_proj"}
ALL_LINEAR = "all-linear"


@dataclass(frozen=True)
class LoraSpec:
    r: int = 16
    alpha: float = 32.0
    dropout: float = 0.0  # PEFT's default; each adapter's drop(x) is its own saved copy of x (memory)
    targets: tuple[str, ...] = ("q", "k", "v", "o", "gate", "up", "down")  # or (ALL_LINEAR,)
    rslora: bool = False
    base: str = "none"  # QLoRA: the frozen blocks' linear layers held int8 or int4 (qkv.nn.quant)

    @property
    def scaling(self) -> float:
        return self.alpha / (math.sqrt(self.r) if self.rslora else self.r)

    def to_text(self) -> str:
        text = f"r={self.r},alpha={self.alpha:g},dropout={self.dropout:g},targets={','.join(self.targets)}"
        return text + (",rslora=true" if self.rslora else "") + (f",base={self.base}" if self.base != "none" else "")


def parse_spec(text: str) -> LoraSpec:
    """`r=16,alpha=32,dropout=0.05,targets=q,k,v` -> LoraSpec; a name after targets= without `=` is a target."""
    fields: dict[str, object] = {}
    key = None
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        if "=" not in part:
            if key != "targets":
                raise QkvError(f"--lora {text!r}: {part!r} is not NAME=VALUE (names: r, alpha, dropout, targets, "
                               "rslora, base)")
            fields["targets"] += (part,)
            continue
        key, value = (s.strip() for s in part.split("=", 1))
        fields[key] = (value,) if key == "targets" else value
    unknown = sorted(set(fields) - {"r", "alpha", "dropout", "targets", "rslora", "base"})
    if unknown:
        raise QkvError(f"--lora: unknown field {unknown[0]!r}; choose from r, alpha, dropout, targets, rslora, base")
    try:
        r = int(fields.get("r", 16))
        alpha = float(fields.get("alpha", 2 * r))
        dropout = float(fields.get("dropout", LoraSpec.dropout))
    except ValueError as error:
        raise QkvError(f"--lora {text!r}: {error}") from None
    rslora = str(fields.get("rslora", "false")).lower()
    if rslora not in ("true", "false"):
        raise QkvError(f"--lora: rslora={rslora!r}; true or false")
    targets = tuple(fields.get("targets", LoraSpec.targets))
    spec = LoraSpec(r=r, alpha=alpha, dropout=dropout, targets=targets, rslora=rslora == "true",
                    base=str(fields.get("base", "none")))
    check_spec(spec)
    return spec


def check_spec(spec: LoraSpec) -> None:
    if spec.r < 1:
        raise QkvError(f"--lora: r={spec.r} must be a positive integer")
    if not (math.isfinite(spec.alpha) and spec.alpha > 0):
        raise QkvError(f"--lora: alpha={spec.alpha} must be a positive number")
    if not 0.0 <= spec.dropout < 1.0:
        raise QkvError(f"--lora: dropout={spec.dropout} must be in [0, 1)")
    if spec.base not in QUANTS:
        raise QkvError(f"--lora: base={spec.base!r}; choose from {', '.join(QUANTS)} (QLoRA: int8 or int4)")
    if spec.targets != (ALL_LINEAR,):
        wrong = [t for t in spec.targets if t not in TARGETS]
        if wrong or not spec.targets:
            raise QkvError(f"--lora: target {wrong[0] if wrong else '(none)'!r}; choose from "
                           f"{', '.join(TARGETS)} or {ALL_LINEAR}")


class LoRALinear(nn.Module):
    """base(x) + s B A drop(x) (above); `base_layer` frozen, `lora_A` and `lora_B` trained. PEFT's names."""

    def __init__(self, base: nn.Module, spec: LoraSpec):
        super().__init__()
        self.base_layer = base
        for param in base.parameters():
            param.requires_grad_(False)
        self.in_features, self.out_features = base.in_features, base.out_features
        self.lora_A = nn.Linear(self.in_features, spec.r, bias=False)  # A (r, K)
        self.lora_B = nn.Linear(spec.r, self.out_features, bias=False)  # B (N, r)
        nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5))
        nn.init.zeros_(self.lora_B.weight)
        self.lora_dropout = nn.Dropout(spec.dropout) if spec.dropout else nn.Identity()
        self.scaling = spec.scaling
        self.enabled = True  # False: the base alone (DPO's reference model, no second copy)

    def forward(self, x: Tensor) -> Tensor:
        out = self.base_layer(x)
        if not self.enabled:
            return out
        return out + self.lora_B(self.lora_A(self.lora_dropout(x))) * self.scaling

    def delta(self) -> Tensor:
        """s B A (N, K): what merging adds to W."""
        return (self.lora_B.weight @ self.lora_A.weight) * self.scaling


def is_target(name: str, module: nn.Module, spec: LoraSpec) -> bool:
    """A linear layer inside the blocks whose last name part is a target (never the head or an embedding)."""
    if not isinstance(module, (nn.Linear, QuantLinear)) or not name.startswith("blocks."):
        return False
    last = name.rpartition(".")[2]
    return spec.targets == (ALL_LINEAR,) or last in {TARGETS[t] for t in spec.targets}


def apply_lora(model: nn.Module, spec: LoraSpec) -> list[str]:
    """Freeze every parameter of `model` and put a LoRALinear over each target layer; the names adapted."""
    for param in model.parameters():
        param.requires_grad_(False)
    replaced = swap(model, lambda name, module: is_target(name, module, spec), lambda module: LoRALinear(module, spec))
    if not replaced:
        raise QkvError(f"--lora targets={','.join(spec.targets)}: no such linear layer in this model's blocks")
    return [name for name, _ in replaced]


def lora_model(model: nn.Module, spec: LoraSpec, *, empty: bool = False) -> list[str]:
    """`model` made ready for LoRA training or loading: with QLoRA its blocks' linear layers quantized first
    (`empty`: zero codes of the right shapes, to load saved ones into), then the adapters over the targets."""
    if spec.base != "none":
        def quantized(linear: nn.Linear) -> nn.Module:
            if empty:
                return QuantLinear.empty(spec.base, linear.in_features, linear.out_features, linear.bias is not None)
            return QuantLinear.from_linear(linear, spec.base)

        with torch.no_grad():
            swap(model, lambda name, module: quantizable(name, module) and name.startswith("blocks."), quantized)
    return apply_lora(model, spec)


def adapters(model: nn.Module) -> dict[str, LoRALinear]:
    return {name: module for name, module in model.named_modules() if isinstance(module, LoRALinear)}


@contextlib.contextmanager
def adapters_off(model: nn.Module) -> Iterator[nn.Module]:
    """For the duration: the base model alone (every adapter's update skipped)."""
    layers = list(adapters(model).values())
    try:
        for layer in layers:
            layer.enabled = False
        yield model
    finally:
        for layer in layers:
            layer.enabled = True


@torch.no_grad()
def merge_lora(model: nn.Module) -> int:
    """Fold every adapter into its base weight (W' = W + s B A) and put the plain layer back; a quantized base
    becomes an fp32 nn.Linear of its dequantized weight plus the update. Returns the number merged."""
    def merged(layer: LoRALinear) -> nn.Module:
        base = layer.base_layer
        has_bias = getattr(base, "bias", None) is not None
        linear = nn.Linear(layer.in_features, layer.out_features, bias=has_bias, device=layer.lora_A.weight.device)
        linear.weight.copy_(base.weight.float() + layer.delta().float())
        if has_bias:
            linear.bias.copy_(base.bias)
        return linear.to(base.weight.dtype) if isinstance(base, nn.Linear) else linear

    return len(swap(model, lambda name, module: isinstance(module, LoRALinear), merged))


def trainable_count(model: nn.Module) -> tuple[int, int]:
    """(trainable parameters, all parameters), a tied tensor once; a quantized base counts its weights too."""
    params = {id(p): p for p in model.parameters()}
    total = sum(p.numel() for p in params.values())
    total += sum(m.in_features * m.out_features for m in model.modules() if isinstance(m, QuantLinear))
    return sum(p.numel() for p in params.values() if p.requires_grad), total
