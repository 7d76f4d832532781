"""Residual placement as a wrapper function: one signature `(x, norm, sublayer, *args)`.

Post-LN (the original Transformer, note 000 §6.1): LN(x + F(x)).
Pre-LN (GPT-2 onwards, note 003): x + F(LN(x)).
Note 002 writes Post-Norm as x + LN(F(x)); that is neither of the two (docs/DEVIATIONS.md).
"""
from __future__ import annotations

from typing import Callable

from torch import Tensor

from qkv.registry import Registry

RESIDUALS: Registry[Callable[..., Tensor]] = Registry("norm placement")


@RESIDUALS.register("pre")
def pre_norm(x: Tensor, norm: Callable, sublayer: Callable, *args) -> Tensor:
    return x + sublayer(norm(x), *args)


@RESIDUALS.register("post")
def post_norm(x: Tensor, norm: Callable, sublayer: Callable, *args) -> Tensor:
    return norm(x + sublayer(x, *args))
