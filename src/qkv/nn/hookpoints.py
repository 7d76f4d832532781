"""Named hook points: every tensor the notes name, readable and replaceable from outside the model.

The models call `point(self, "resid_pre", x)` at each place below; with no hooks installed it returns `x` at
its first line (the decoding speed is unchanged: docs/interpretability.md).
Installed hooks (`hooked(model, [(name, fn)])`, or qkv.interp's run_with_hooks / run_with_cache) see the
tensor and may return a replacement, which the forward then continues with. The names are the module's
qualified name in the model and the point's:

    embed                         H0: token embedding (+ positions), before the first block      (B, T, D)
    blocks.{i}.resid_pre          the residual stream entering block i (blocks.0.resid_pre = embed) (B, T, D)
    blocks.{i}.attn.q / .k / .v   Q, K, V per head, after RoPE where the model rotates         (B, H, T, Dh)
                                  (k and v: H_kv heads; this call's positions, before the KV cache)
    blocks.{i}.attn.scores        S = Q K^T / sqrt(Dh) + bias + M (M = -inf where masked), before the softmax;
                                  formed only when hooked (a linear-attention model: phi(Q) phi(K)^T) (B, H, T, S)
    blocks.{i}.attn.pattern       A = softmax(S), formed only when hooked                       (B, H, T, S)
    blocks.{i}.attn.z             A V per head, before W^O                                     (B, H, T, Dh)
    blocks.{i}.attn.out           the attention sublayer's output, z W^O^T (+ b)               (B, T, D)
    blocks.{i}.resid_mid          the stream after the attention residual                      (B, T, D)
    blocks.{i}.ffn.pre            the FFN's hidden activation, act(x W1^T) or act(x W_g^T) * x W_u^T (B, T, F)
    blocks.{i}.ffn.post           the FFN sublayer's output                                    (B, T, D)
    blocks.{i}.ffn.router         an MoE layer's router scores s over its E experts (qkv.nn.moe) (B, T, E)
    blocks.{i}.ffn.gates          each token's gate of every expert, 0 where not chosen; formed
                                  only when hooked (a replacement reroutes)                    (B, T, E)
                                  (each expert's own points: blocks.{i}.ffn.experts.{e}.pre / .post,
                                  over the rows routed to it)
    blocks.{i}.resid_post         the stream leaving block i                                   (B, T, D)
    final_norm                    LN(H^L), what the head reads                                 (B, T, D)
    logits                        the head's output                                            (B, T, V)

An encoder-decoder's decoder blocks also have `blocks.{i}.cross_attn.*` (its K/V from the encoder output),
under `encoder.` / `decoder.` prefixes as the model names its stacks.
"""
from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Callable, Iterator

from torch import Tensor, nn

from qkv.errors import QkvError

Hook = Callable[[Tensor, str], "Tensor | None"]  # (tensor, name) -> a replacement, or None to keep it

_ACTIVE = threading.local()  # .table: {name: [hook, ...]} while hooks are installed in this thread
_INSTALLED = [0]  # hooked() blocks open in any thread: 0 means every point returns at its first line

POINTS_ATTRIBUTE = "hook_points"  # each module class that calls point() lists its points under this name


def point(module: nn.Module, name: str, x: Tensor) -> Tensor:
    """`x`, or what the hooks installed at `module`'s point `name` make of it."""
    if not _INSTALLED[0]:
        return x
    full, hooks = _hooks_at(module, name)
    for hook in hooks:
        replaced = hook(x, full)
        if replaced is not None:
            if replaced.shape != x.shape:
                raise QkvError(f"hook at {full} returned shape {tuple(replaced.shape)}; {full} is {tuple(x.shape)}")
            x = replaced
    return x


def wants(module: nn.Module, name: str) -> bool:
    """A hook sits at this module's point `name` (for points that cost work to form, like the pattern)."""
    return bool(_INSTALLED[0]) and bool(_hooks_at(module, name)[1])


def _hooks_at(module: nn.Module, name: str) -> tuple[str, list[Hook]]:
    """The full name of `module`'s point `name` and the hooks this thread installed there."""
    full = f"{module.__dict__.get('_point_prefix', '')}{name}"
    return full, (getattr(_ACTIVE, "table", None) or {}).get(full, [])


def hook_names(model: nn.Module) -> list[str]:
    """Every hook point of `model`, in forward order within each module."""
    names = []
    for qualified, module in model.named_modules():
        prefix = f"{qualified}." if qualified else ""
        names += [f"{prefix}{p}" for p in getattr(type(module), POINTS_ATTRIBUTE, ())]
    return names


def name_points(model: nn.Module) -> None:
    """Tell each module its qualified name (point() builds the full names from it)."""
    for qualified, module in model.named_modules():
        if getattr(type(module), POINTS_ATTRIBUTE, ()):
            object.__setattr__(module, "_point_prefix", f"{qualified}." if qualified else "")


@contextmanager
def hooked(model: nn.Module, hooks: list[tuple[str, Hook]]) -> Iterator[nn.Module]:
    """Install `hooks` [(point name, fn)] on `model` for the duration (this thread); unknown names are refused
    with the list of the model's points. They compose with the KV cache: a generate call inside the block runs
    every step's points through them (each step's tensors cover its new positions only)."""
    known = set(hook_names(model))
    unknown = sorted({name for name, _ in hooks} - known)
    if unknown:
        sample = ", ".join(list(known)[:8])
        raise QkvError(f"no hook point {', '.join(unknown)}; this model has {len(known)} (e.g. {sample}; "
                       "qkv.nn.hookpoints.hook_names lists them)")
    name_points(model)
    table: dict[str, list[Hook]] = {}
    for name, fn in hooks:
        table.setdefault(name, []).append(fn)
    previous = getattr(_ACTIVE, "table", None)
    merged = {**(previous or {})}
    for name, fns in table.items():
        merged[name] = [*merged.get(name, ()), *fns]
    _ACTIVE.table = merged
    _INSTALLED[0] += 1
    try:
        yield model
    finally:
        _INSTALLED[0] -= 1
        _ACTIVE.table = previous
