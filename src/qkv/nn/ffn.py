"""Position-wise feed-forward networks (note 000 §4, §9; note 003 on SwiGLU).

FFN(x) = act(x W1 + b1) W2 + b2, applied to every position independently (note 000 §4.1).
The GLU family (note 003): FFN(x) = (act(x W_gate) * (x W_up)) W_down; SwiGLU is act = SiLU,
GeGLU is act = GELU. Every FFN takes `(d_model, d_ff, *, activation, bias, dropout)`.
"""
from __future__ import annotations

import functools
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from qkv.nn.fastpath import fused_or_none
from qkv.nn.hookpoints import point
from qkv.registry import Registry

ACTIVATIONS: Registry[Callable[[Tensor], Tensor]] = Registry("activation")
ACTIVATIONS.register("relu")(F.relu)
ACTIVATIONS.register("gelu")(F.gelu)  # exact: x * Phi(x)
ACTIVATIONS.register("gelu_tanh")(functools.partial(F.gelu, approximate="tanh"))
ACTIVATIONS.register("silu")(F.silu)  # Swish-1: x * sigmoid(x)
ACTIVATIONS.register("leaky_relu")(functools.partial(F.leaky_relu, negative_slope=0.01))
ACTIVATIONS.register("relu6")(F.relu6)
# ReLU^2 (So et al. 2021, Primer; modded-nanogpt): relu(x)^2, zero for x <= 0 like ReLU, smooth at 0
ACTIVATIONS.register("relu2")(lambda x: F.relu(x).square())

FFNS: Registry[type[nn.Module]] = Registry("ffn")


@FFNS.register("mlp")
class MLP(nn.Module):
    def __init__(self, d_model: int, d_ff: int, *, activation: str, bias: bool, dropout: float = 0.0):
        super().__init__()
        self.act = ACTIVATIONS.get(activation)
        self.up_proj = nn.Linear(d_model, d_ff, bias=bias)  # W1 (F, D)
        self.down_proj = nn.Linear(d_ff, d_model, bias=bias)  # W2 (D, F)
        self.dropout = nn.Dropout(dropout) if dropout else nn.Identity()  # p = 0: no dropout kernel at all

    hook_points = ("pre", "post")  # qkv.nn.hookpoints

    def forward(self, x: Tensor) -> Tensor:  # (B, T, D) -> (B, T, D)
        return self.dropout(point(self, "post", self.down_proj(point(self, "pre", self.act(self.up_proj(x))))))


@FFNS.register("glu")
class GLU(nn.Module):
    hook_points = ("pre", "post")  # qkv.nn.hookpoints
    def __init__(self, d_model: int, d_ff: int, *, activation: str, bias: bool, dropout: float = 0.0):
        super().__init__()
        self.act = ACTIVATIONS.get(activation)
        self.gate_proj = nn.Linear(d_model, d_ff, bias=bias)  # (F, D)
        self.up_proj = nn.Linear(d_model, d_ff, bias=bias)  # (F, D)
        self.down_proj = nn.Linear(d_ff, d_model, bias=bias)  # (D, F)
        self.dropout = nn.Dropout(dropout) if dropout else nn.Identity()  # p = 0: no dropout kernel at all

    def forward(self, x: Tensor) -> Tensor:  # (B, T, D) -> (B, T, D)
        fused = fused_or_none(self, "fused_gate_up", self.gate_proj, self.up_proj)
        if fused is not None:  # [gate up] = x [W_gate; W_up]^T in one product (qkv.nn.fuse, inference)
            gate, up = fused(x).chunk(2, dim=-1)
            hidden = self.act(gate) * up
        else:
            hidden = self.act(self.gate_proj(x)) * self.up_proj(x)
        return self.dropout(point(self, "post", self.down_proj(point(self, "pre", hidden))))


CLAMP_LIMIT, CLAMP_ALPHA = 7.0, 1.702  # gpt-oss's swiglu_limit and SiLU slope


@FFNS.register("glu_clamped")
class ClampedGLU(GLU):
    """gpt-oss's SwiGLU (OpenAI 2025): g = min(x W_gate, l), u = clip(x W_up, -l, l),
    FFN(x) = ((u + 1) * g sigmoid(alpha g)) W_down, l = 7, alpha = 1.702: a SiLU of slope alpha on a gate clamped
    from above, the up branch clamped both ways and shifted by one. `activation` is not read."""

    def forward(self, x: Tensor) -> Tensor:  # (B, T, D) -> (B, T, D)
        gate = self.gate_proj(x).clamp(max=CLAMP_LIMIT)
        up = self.up_proj(x).clamp(-CLAMP_LIMIT, CLAMP_LIMIT)
        hidden = (up + 1) * gate * torch.sigmoid(CLAMP_ALPHA * gate)
        return self.dropout(point(self, "post", self.down_proj(point(self, "pre", hidden))))
