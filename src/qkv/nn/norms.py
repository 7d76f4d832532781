"""Normalisation layers (note 000 §5; note 003 on RMSNorm).

Every norm takes `(dim, *, eps, bias)`. Statistics are computed in at least fp32: the mean and variance of
bf16/fp16 activations lose most of their bits, which is why mixed precision keeps norms in fp32.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from qkv.registry import Registry

NORMS: Registry[type[nn.Module]] = Registry("norm")
WIDE = (torch.float32, torch.float64)  # dtypes whose statistics need no upcast


@NORMS.register("layernorm")
class LayerNorm(nn.Module):
    """LN(x) = gamma * (x - mu) / sqrt(sigma^2 + eps) + beta over the last axis (note 000 §5.1)."""

    def __init__(self, dim: int, *, eps: float, bias: bool = True):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))  # gamma (D,)
        self.bias = nn.Parameter(torch.zeros(dim)) if bias else None  # beta (D,)

    def forward(self, x: Tensor) -> Tensor:
        if x.dtype == self.weight.dtype and x.dtype in WIDE:  # already at least fp32: no casts (decoding speed)
            return F.layer_norm(x, self.weight.shape, self.weight, self.bias, self.eps)
        # statistics in at least fp32 (see module docstring)
        dtype = torch.promote_types(x.dtype, torch.float32)
        bias = None if self.bias is None else self.bias.to(dtype)
        y = F.layer_norm(x.to(dtype), self.weight.shape, self.weight.to(dtype), bias, self.eps)
        return y.to(x.dtype)


@NORMS.register("rmsnorm")
class RMSNorm(nn.Module):
    """RMSNorm(x) = gamma * x / sqrt(mean(x^2) + eps): LayerNorm without the mean (note 003)."""

    def __init__(self, dim: int, *, eps: float, bias: bool = False):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))  # gamma (D,)

    def forward(self, x: Tensor) -> Tensor:
        if x.dtype == self.weight.dtype and x.dtype in WIDE:  # as LayerNorm: no casts needed
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        dtype = torch.promote_types(x.dtype, torch.float32)  # at least fp32, as LayerNorm
        y = F.rms_norm(x.to(dtype), self.weight.shape, self.weight.to(dtype), self.eps)
        return y.to(x.dtype)
