"""Residual placement as a wrapper function: one signature `(x, norm, sublayer, *args)`.

Post-LN (the original Transformer, note 000 §6.1): LN(x + F(x)).
Pre-LN (GPT-2 onwards, note 003): x + F(LN(x)).
Sandwich (beyond the notes; CogView, Ding et al. 2021, and NormFormer's extra post-sublayer norm):
x + LN_out(F(LN_in(x))): a pre-LN block whose sublayer output is normalised before it joins the stream.
Note 002 writes Post-Norm as x + LN(F(x)); that is neither of the first two (docs/DEVIATIONS.md).

A placement that needs two norms per sublayer receives them as one `NormPair` module (`norm.inner`,
`norm.outer`), so the block keeps one norm attribute per sublayer and its signature; `sublayer_norm`
builds what a placement needs.
"""
from __future__ import annotations

from typing import Callable

from torch import Tensor, nn

from qkv.registry import Registry

RESIDUALS: Registry[Callable[..., Tensor]] = Registry("norm placement")
PAIRED = ("sandwich",)  # placements whose `norm` is a NormPair
STREAM_NORMED = ("post",)  # placements whose blocks end in a norm: the stack needs no final norm


class NormPair(nn.Module):
    """The two norms of one sandwich sublayer: `inner` on its input, `outer` on its output."""

    def __init__(self, inner: nn.Module, outer: nn.Module):
        super().__init__()
        self.inner, self.outer = inner, outer


def sublayer_norm(placement: str, make_norm: Callable[[], nn.Module]) -> nn.Module:
    """The norm module one sublayer of `placement` takes: a NormPair for sandwich, else one norm."""
    return NormPair(make_norm(), make_norm()) if placement in PAIRED else make_norm()


def needs_final_norm(placement: str) -> bool:
    """Pre-LN and sandwich stacks leave the residual stream unnormalised: they end with a norm."""
    return placement not in STREAM_NORMED


@RESIDUALS.register("pre")
def pre_norm(x: Tensor, norm: Callable, sublayer: Callable, *args) -> Tensor:
    return x + sublayer(norm(x), *args)


@RESIDUALS.register("post")
def post_norm(x: Tensor, norm: Callable, sublayer: Callable, *args) -> Tensor:
    return norm(x + sublayer(x, *args))


@RESIDUALS.register("sandwich")
def sandwich_norm(x: Tensor, norm: NormPair, sublayer: Callable, *args) -> Tensor:
    return x + norm.outer(sublayer(norm.inner(x), *args))
