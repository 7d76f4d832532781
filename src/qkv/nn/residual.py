"""Residual placement as a wrapper function: one signature `(x, norm, sublayer, *args)`.

Post-LN (the original Transformer, note 000 §6.1): LN(x + F(x)).
Pre-LN (GPT-2 onwards, note 003): x + F(LN(x)).
Sandwich (beyond the notes; CogView, Ding et al. 2021, and NormFormer's extra post-sublayer norm):
x + LN_out(F(LN_in(x))): a pre-LN block whose sublayer output is normalised before it joins the stream.
Note 002 writes Post-Norm as x + LN(F(x)); that is neither of the first two (docs/DEVIATIONS.md).

A placement that needs two norms per sublayer receives them as one `NormPair` module (`norm.inner`,
`norm.outer`), so the block keeps one norm attribute per sublayer and its signature; `sublayer_norm`
builds what a placement needs. Each registry entry is a `Placement`: the wrapper and its two facts.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from torch import Tensor, nn

from qkv.registry import Registry



@dataclass(frozen=True)
class Placement:
    """One residual placement: the registry entry of model.norm_placement."""

    apply: Callable[..., Tensor]  # (x, norm, sublayer, *args) -> the sublayer's residual update of x
    paired: bool = False  # each sublayer's `norm` is an (inner, outer) NormPair
    final_norm: bool = True  # the blocks leave the stream unnormalised: the stack ends with a norm


RESIDUALS: Registry[Placement] = Registry("norm placement")


class NormPair(nn.Module):
    """The two norms of one sandwich sublayer: `inner` on its input, `outer` on its output."""

    def __init__(self, inner: nn.Module, outer: nn.Module):
        super().__init__()
        self.inner, self.outer = inner, outer


def sublayer_norm(placement: str, make_norm: Callable[[], nn.Module]) -> nn.Module:
    """The norm module one sublayer of `placement` takes: a NormPair for sandwich, else one norm."""
    return NormPair(make_norm(), make_norm()) if RESIDUALS.get(placement).paired else make_norm()


def pre_norm(x: Tensor, norm: Callable, sublayer: Callable, *args) -> Tensor:
    return x + sublayer(norm(x), *args)


def post_norm(x: Tensor, norm: Callable, sublayer: Callable, *args) -> Tensor:
    return norm(x + sublayer(x, *args))


def sandwich_norm(x: Tensor, norm: NormPair, sublayer: Callable, *args) -> Tensor:
    return x + norm.outer(sublayer(norm.inner(x), *args))


RESIDUALS.register("pre")(Placement(pre_norm))
RESIDUALS.register("post")(Placement(post_norm, final_norm=False))  # every block already ends in a norm
RESIDUALS.register("sandwich")(Placement(sandwich_norm, paired=True))
