"""Residual placement and the Transformer block, forward and backward.

A `Sublayer` is a forward/backward pair already bound to its parameters. Residual placement is a pair
of functions over (x, norm, sublayer), as in qkv.nn.residual:
    Pre-LN  (note 003):       y = x + F(LN(x))   ->  dx = dy + LN'^T F'^T dy
    Post-LN (000 §6.1):       y = LN(x + F(x))   ->  dz = LN'^T dy,  dx = dz + F'^T dz   (000 §6.3:
                              d(x + F(x))/dx = I + dF/dx: the identity path is the "+ dz")
    Sandwich (CogView, NormFormer): y = x + LN_out(F(LN_in(x)))  ->  dx = dy + LN_in'^T F'^T LN_out'^T dy
                              (its `norm` is the pair (inner, outer); parameter names norm.inner.*, norm.outer.*)
The block calls its residuals in order; its backward calls their backward twins in the reverse order.
Every backward has the engine's one form (qkv.ref.functional): dx = backward(dy, cache, grads).
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Iterator, NamedTuple

import numpy as np

from qkv.ref.attention import attention_backward, attention_forward
from qkv.ref.ffn import FFNS
from qkv.ref.functional import Grads, scope
from qkv.ref.mla import latent_backward, latent_forward
from qkv.ref.moe import MoECache, Routing, moe_backward, moe_forward
from qkv.ref.norms import NORMS
from qkv.registry import Registry


class Sublayer(NamedTuple):
    forward: Callable  # x -> (y, cache)
    backward: Callable  # (dy, cache, grads) -> dx


class Residual(NamedTuple):
    forward: Callable  # (x, norm, sub) -> (y, cache)
    backward: Callable  # (dy, cache, norm, sub, norm_grads, sub_grads) -> dx
    paired: bool = False  # the sublayer norm is an (inner, outer) pair (as qkv.nn.residual.Placement)
    final_norm: bool = True  # the stack ends with a norm


RESIDUALS: Registry[Residual] = Registry("norm placement")


def pre_forward(x, norm: Sublayer, sub: Sublayer):
    h, cn = norm.forward(x)
    s, cs = sub.forward(h)
    return x + s, (cn, cs)


def pre_backward(dy, cache, norm: Sublayer, sub: Sublayer, norm_grads: Grads, sub_grads: Grads):
    cn, cs = cache
    dh = sub.backward(dy, cs, sub_grads)
    return dy + norm.backward(dh, cn, norm_grads)  # the residual path carries dy through unchanged


def post_forward(x, norm: Sublayer, sub: Sublayer):
    s, cs = sub.forward(x)
    y, cn = norm.forward(x + s)
    return y, (cn, cs)


def post_backward(dy, cache, norm: Sublayer, sub: Sublayer, norm_grads: Grads, sub_grads: Grads):
    cn, cs = cache
    dz = norm.backward(dy, cn, norm_grads)
    return dz + sub.backward(dz, cs, sub_grads)


def sandwich_forward(x, norm: tuple[Sublayer, Sublayer], sub: Sublayer):
    inner, outer = norm
    h, ci = inner.forward(x)
    s, cs = sub.forward(h)
    o, co = outer.forward(s)
    return x + o, (ci, cs, co)


def sandwich_backward(dy, cache, norm: tuple[Sublayer, Sublayer], sub: Sublayer, norm_grads: Grads,
                      sub_grads: Grads):
    (inner, outer), (ci, cs, co) = norm, cache
    ds = outer.backward(dy, co, norm_grads.scope("outer"))
    dh = sub.backward(ds, cs, sub_grads)
    return dy + inner.backward(dh, ci, norm_grads.scope("inner"))


RESIDUALS.register("pre")(Residual(pre_forward, pre_backward))
RESIDUALS.register("post")(Residual(post_forward, post_backward, final_norm=False))
RESIDUALS.register("sandwich")(Residual(sandwich_forward, sandwich_backward, paired=True))


# ---- sublayers bound to their parameters -----------------------------------------------------

def norm_sublayer(params: dict, cfg) -> Sublayer:
    norm = NORMS.get(cfg.norm)
    return Sublayer(lambda x: norm.forward(params, x, cfg.norm_eps), norm.backward)


def sublayer_norm(params: dict, cfg):
    """What the placement takes: one norm, or the (inner, outer) pair of a sandwich."""
    if RESIDUALS.get(cfg.norm_placement).paired:
        return norm_sublayer(scope(params, "inner"), cfg), norm_sublayer(scope(params, "outer"), cfg)
    return norm_sublayer(params, cfg)


def attention_sublayer(params: dict, ctx, memory=None) -> Sublayer:
    if "kv_a_proj.weight" in params:  # multi-head latent attention (model.mla_kv_rank: qkv.ref.mla)
        return Sublayer(lambda x: latent_forward(params, x, ctx), latent_backward)
    return Sublayer(lambda x: attention_forward(params, x, ctx, memory), attention_backward)


def ffn_sublayer(params: dict, cfg, aux_weight: float) -> Sublayer:
    if "router.weight" in params:  # an MoE layer (qkv.plan: a model's moe_dense_layers have none)
        routing = Routing(*(getattr(cfg, f"moe_{name}", default) for name, default in (
            ("scoring", "softmax"), ("norm_topk", True), ("scale", 1.0), ("groups", 0), ("group_top_k", 0))))

        def forward(x):
            return moe_forward(params, x, ffn=cfg.ffn, activation=cfg.activation, experts=cfg.moe_experts,
                               top_k=cfg.moe_top_k, aux_weight=aux_weight,
                               capacity_factor=getattr(cfg, "moe_capacity_factor", 0.0), routing=routing)
        backward = moe_backward
    else:
        ffn = FFNS.get(cfg.ffn)
        forward, backward = (lambda x: ffn.forward(params, x, cfg.activation)), ffn.backward
    return Sublayer(forward, backward)


def _parts(params: dict, cfg, ctx, memory, memory_ctx, aux_weight: float):
    """(name, norm name, norm, sublayer) in forward order; cross-attention only with a memory."""
    parts = [("attn", "attn_norm", attention_sublayer(scope(params, "attn"), ctx))]
    if memory is not None:
        parts.append(("cross_attn", "cross_norm", attention_sublayer(scope(params, "cross_attn"), memory_ctx, memory)))
    parts.append(("ffn", "ffn_norm", ffn_sublayer(scope(params, "ffn"), cfg, aux_weight)))
    return [(name, norm_name, sublayer_norm(scope(params, norm_name), cfg), sub) for name, norm_name, sub in parts]


# A recorder (qkv.explain.tap.Recorder) while `tapped` is active: every block built then has its
# placement, norms, sublayers and attention kernel wrapped by the recorder's, which call the engine's own
# functions and keep their inputs, outputs and gradients. None otherwise: the engine as written.
TAP = None


@contextmanager
def tapped(recorder) -> Iterator:
    """with tapped(recorder): forward(...); backward(...) -- the recorder sees every block's steps."""
    global TAP
    previous, TAP = TAP, recorder
    try:
        yield recorder
    finally:
        TAP = previous


class BlockCache(NamedTuple):
    parts: list  # (name, norm name, norm, sublayer) in forward order
    caches: list  # each part's residual cache
    residual: Residual  # the placement


def block_forward(params: dict, x: np.ndarray, cfg, ctx, memory=None, memory_ctx=None, aux_weight: float = 0.0):
    """x (B, T, D) -> (B, T, D): self-attention, cross-attention (with `memory`), FFN, each in a residual."""
    residual = RESIDUALS.get(cfg.norm_placement)
    if TAP is not None:
        ctx, memory_ctx = TAP.context(ctx), memory_ctx and TAP.context(memory_ctx)
    parts = _parts(params, cfg, ctx, memory, memory_ctx, aux_weight)
    if TAP is not None:
        residual, parts = TAP.block(residual, parts, params, cfg)
    caches = []
    for _, _, norm, sub in parts:
        x, cache = residual.forward(x, norm, sub)
        caches.append(cache)
    return x, BlockCache(parts, caches, residual)


def block_backward(dy: np.ndarray, cache, grads: Grads) -> np.ndarray:
    """The residuals' backward twins in reverse order. Returns dx."""
    parts, caches, residual = cache
    for (name, norm_name, norm, sub), part_cache in zip(reversed(parts), reversed(caches)):
        dy = residual.backward(dy, part_cache, norm, sub, grads.scope(norm_name), grads.scope(name))
    return dy


def aux_losses(cache) -> float:
    """The MoE load-balancing losses recorded in one block's forward (0 for a dense FFN)."""
    parts, caches, _ = cache
    ffn_caches = [cache[1] for cache in caches]  # every placement caches (norm, sublayer, ...) in this order
    return sum(sub_cache.aux for sub_cache in ffn_caches if isinstance(sub_cache, MoECache))
