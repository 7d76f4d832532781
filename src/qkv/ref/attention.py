"""Multi-head attention layer, forward and backward (000 LLM §2.2.1 forward, §3.3.3 backward).

MHA, GQA and MQA are one layer chosen by the shapes of k_proj / v_proj (n_kv_heads); cross-attention
(000 §8.4) takes keys and values from `memory`; every decoder layer reads the same memory, so its gradient
is accumulated, as a parameter's is, under the name MEMORY_GRAD (the encoder-decoder's backward takes it
from there into the encoder). Parameter names are
those of qkv.nn.attention.Attention: q_proj, k_proj, v_proj, o_proj, each with weight (out, in) and bias.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

from qkv.ref import flash, linear_attention  # noqa: F401  (register the "flash" and "linear" kernels)
from qkv.ref.functional import Grads, linear_backward, linear_forward, scope
from qkv.ref.kernels import Kernel, causal_mask
from qkv.ref.norms import rmsnorm_backward, rmsnorm_forward
from qkv.ref.positional import Positional


MEMORY_GRAD = "<memory>"  # dL/dMemory, summed over the cross-attention layers (not a parameter)


@dataclass
class AttentionContext:
    """What every attention layer of one forward pass shares (as qkv.nn.attention.AttentionContext)."""

    positional: Positional  # its rotate / score_bias hooks (identity for cross-attention)
    positions: np.ndarray  # (B, T) positions of the queries
    key_positions: np.ndarray  # (B, S) positions of the keys
    mask: np.ndarray | None  # (B, 1, T, S) bool, True where attention is allowed
    causal: bool  # the kernel applies the causal triangle itself (mask is None)
    kernel: Kernel
    n_heads: int
    params: dict = field(default_factory=dict)  # the positional encoding's parameters (shared by the layers)
    positional_prefix: str = "positional."  # their full names' prefix: where every layer adds their gradients
    norm_eps: float = 1e-5  # model.qk_norm's RMSNorm epsilon (model.norm_eps)
    scale: float = 0.0  # the scores' factor where it is not Dh^-1/2 (model.query_scale^-1/2)
    softcap: float = 0.0  # c > 0: scores c tanh(s / c) before the mask (model.attn_softcap)


class AttentionCache(NamedTuple):
    """What attention_forward keeps for attention_backward."""

    q_proj: tuple  # linear_forward's cache of each projection
    k_proj: tuple
    v_proj: tuple
    rotation: Any  # the positional encoding's rotate_forward cache
    score_bias: Any  # its score_bias_forward cache
    kernel: Any  # the kernel's forward cache
    o_proj: tuple
    ctx: AttentionContext
    groups: int  # query heads per key/value head (H / Hkv)
    cross: bool  # keys and values came from a memory (cross-attention)
    q_norm: tuple | None = None  # model.qk_norm: the per-head RMSNorm caches of q and k, else None
    k_norm: tuple | None = None
    qk_norm_whole: bool = False  # model.qk_norm_whole: the norms ran on the merged rows (B, T, H*Dh)
    sinks: bool = False  # the kernel saw one more key column, the sinks' (with_sink)
    own_bias: bool = False  # the positional encoding gave a score bias of its own (beside the sinks' column)


def split_heads(x: np.ndarray, heads: int) -> np.ndarray:
    """(B, T, heads*Dh) -> (B, heads, T, Dh): 000 LLM §2.2.1 step 2. Its backward is merge_heads."""
    B, T, width = x.shape
    return x.reshape(B, T, heads, width // heads).transpose(0, 2, 1, 3)


def merge_heads(x: np.ndarray) -> np.ndarray:
    """(B, heads, T, Dh) -> (B, T, heads*Dh): Concat(head_1..head_h), step 4. Its backward is split_heads
    (000 LLM §3.3.3: dL/dhead_h = slice(dL/dMultiHead, h))."""
    B, heads, T, Dh = x.shape
    return x.transpose(0, 2, 1, 3).reshape(B, T, heads * Dh)


def repeat_kv(x: np.ndarray, groups: int) -> np.ndarray:
    """(B, Hkv, S, Dh) -> (B, H, S, Dh): each key/value head serves `groups` query heads (GQA)."""
    return x if groups == 1 else np.repeat(x, groups, axis=1)


def repeat_kv_backward(dx: np.ndarray, groups: int) -> np.ndarray:
    """The adjoint of a copy is a sum: (B, H, S, Dh) -> (B, Hkv, S, Dh)."""
    B, H, S, Dh = dx.shape
    return dx if groups == 1 else dx.reshape(B, H // groups, groups, S, Dh).sum(axis=2)


def attention_forward(params: dict, x: np.ndarray, ctx: AttentionContext, memory: np.ndarray | None = None):
    """x (B, T, D) -> (B, T, D); Q from x, K and V from `memory` (cross-attention) or x (self)."""
    source = x if memory is None else memory  # (B, S, D)
    q, cq = linear_forward(x, **scope(params, "q_proj"))  # Q = H W_Q   (B, T, H*Dh)
    k, ck = linear_forward(source, **scope(params, "k_proj"))  # (B, S, Hkv*Dh)
    v, cv = linear_forward(source, **scope(params, "v_proj"))
    kv_heads = ctx.n_heads * k.shape[-1] // q.shape[-1]
    groups = ctx.n_heads // kv_heads
    cqn = ckn = None
    # model.qk_norm_whole: the gain spans every head (with one head the two norms are one)
    whole = "q_norm.weight" in params and ctx.n_heads > 1 and params["q_norm.weight"].shape[-1] == q.shape[-1]
    if whole:  # QK-norm over all H*Dh features of q (Hkv*Dh of k) at once (OLMoE), before the split
        q, cqn = rmsnorm_forward(scope(params, "q_norm"), q, ctx.norm_eps)
        k, ckn = rmsnorm_forward(scope(params, "k_norm"), k, ctx.norm_eps)
    q, k, v = split_heads(q, ctx.n_heads), split_heads(k, kv_heads), split_heads(v, kv_heads)
    if "q_norm.weight" in params and not whole:  # QK-norm: RMSNorm over each head's Dh features, before the rotation
        q, cqn = rmsnorm_forward(scope(params, "q_norm"), q, ctx.norm_eps)
        k, ckn = rmsnorm_forward(scope(params, "k_norm"), k, ctx.norm_eps)
    q, k, crot = ctx.positional.rotate_forward(q, k, ctx.positions)
    Dh = q.shape[-1]
    k, v = repeat_kv(k, groups), repeat_kv(v, groups)  # (B, H, S, Dh)
    bias, cbias = ctx.positional.score_bias_forward(ctx.params, q, k, ctx.positions, ctx.key_positions)
    value_bias = ctx.positional.value_bias(ctx.params, ctx.positions, ctx.key_positions)
    capped = {"softcap": ctx.softcap} if ctx.softcap else {}  # (the naive kernel: qkv.models.build checks)
    mask, causal, sinks, own_bias = ctx.mask, ctx.causal, params.get("sinks"), bias is not None
    if sinks is not None:  # attention sinks: one more key, scored by the head's sink alone, with a zero value
        k, v, bias, mask = with_sink(k, v, bias, mask, causal, sinks, q.shape[-2])
        causal = False
    heads, ckern = ctx.kernel.forward(q, k, v, mask=mask, causal=causal, bias=bias,
                                      scale=ctx.scale or Dh ** -0.5, value_bias=value_bias, **capped)  # (B, H, T, Dh)
    y, co = linear_forward(merge_heads(heads), **scope(params, "o_proj"))  # MultiHead W_O   (B, T, D)
    return y, AttentionCache(cq, ck, cv, crot, cbias, ckern, co, ctx, groups, cross=memory is not None,
                             q_norm=cqn, k_norm=ckn, qk_norm_whole=whole, sinks=sinks is not None,
                             own_bias=own_bias)


def with_sink(k, v, bias, mask, causal: bool, sinks: np.ndarray, T: int):
    """Attention sinks (gpt-oss) as the kernel's own arithmetic: a key column whose score is the head's sink z_h
    (q . 0 + bias z_h) and whose value is 0, always allowed. softmax over [S ; z_h] then weighs the real keys by
    exp(s_j) / (sum_i exp(s_i) + exp(z_h)), the sinks' formula, and its backward gives dz_h = sum_{b,t} dbias[..., S]."""
    B, H, S, Dh = k.shape
    k = np.concatenate((k, np.zeros((B, H, 1, Dh))), axis=2)
    v = np.concatenate((v, np.zeros((B, H, 1, v.shape[-1]))), axis=2)
    column = np.broadcast_to(sinks[None, :, None, None], (B, H, T, 1))
    bias = np.concatenate((np.zeros((B, H, T, S)) if bias is None else np.broadcast_to(bias, (B, H, T, S)), column),
                          axis=-1)
    allowed = mask if mask is not None else (causal_mask(T, S) if causal else np.ones((T, S), dtype=bool))
    allowed = np.broadcast_to(allowed, (B, 1, T, S)) if allowed.ndim < 4 else allowed
    mask = np.concatenate((allowed, np.ones((*allowed.shape[:-1], 1), dtype=bool)), axis=-1)
    return k, v, bias, mask


def attention_backward(dy: np.ndarray, cache: AttentionCache, grads: Grads) -> np.ndarray:
    """The forward's steps in reverse (000 LLM §3.3.3): o_proj, split, kernel (steps 1-4), the score bias,
    repeat_kv, rotation, merge, projections (step 5). Returns dx; the positional encoding's tables get
    their gradients under ctx.positional_prefix, a cross-attention's memory under MEMORY_GRAD."""
    ctx, groups = cache.ctx, cache.groups
    dmerged = linear_backward(dy, cache.o_proj, grads.scope("o_proj"))  # dMultiHead = dD W_O^T, dW_O = MultiHead^T dD
    dq, dk, dv, dbias, dvalue_table = ctx.kernel.backward(split_heads(dmerged, ctx.n_heads), cache.kernel)
    if cache.sinks:  # the sink column: its bias is the sinks' gradient; its key and value were constants
        grads.add("sinks", dbias[..., -1].sum(axis=(0, 2)))
        dk, dv, dbias = dk[..., :-1, :], dv[..., :-1, :], dbias[..., :-1] if cache.own_bias else None
    positional_grads = grads.at(ctx.positional_prefix)  # one table shared by every layer: each adds its share
    if dbias is not None:  # a learnt / content-dependent bias: dS flows into q, k and the encoding's tables
        dq_bias, dk_bias = ctx.positional.score_bias_backward(dbias, cache.score_bias, positional_grads)
        dq = dq if dq_bias is None else dq + dq_bias
        dk = dk if dk_bias is None else dk + dk_bias
    if dvalue_table is not None:
        positional_grads.add(ctx.positional.value_param, dvalue_table)
    dk, dv = repeat_kv_backward(dk, groups), repeat_kv_backward(dv, groups)
    dq, dk = ctx.positional.rotate_backward(dq, dk, cache.rotation)
    if cache.q_norm is not None and not cache.qk_norm_whole:  # the norms' backward (docs/derivations/rmsnorm.md),
        dq = rmsnorm_backward(dq, cache.q_norm, grads.scope("q_norm"))  # gains summed over heads
        dk = rmsnorm_backward(dk, cache.k_norm, grads.scope("k_norm"))
    dq, dk = merge_heads(dq), merge_heads(dk)
    if cache.qk_norm_whole:  # over all heads' features: the same rule on the merged rows
        dq = rmsnorm_backward(dq, cache.q_norm, grads.scope("q_norm"))
        dk = rmsnorm_backward(dk, cache.k_norm, grads.scope("k_norm"))
    dx = linear_backward(dq, cache.q_proj, grads.scope("q_proj"))  # dW_Q = H^T dQ; dH = dQ W_Q^T + ...
    dsource = (linear_backward(dk, cache.k_proj, grads.scope("k_proj"))
               + linear_backward(merge_heads(dv), cache.v_proj, grads.scope("v_proj")))
    if cache.cross:
        grads.at("").add(MEMORY_GRAD, dsource)  # 000 §8.4: every decoder layer reads the same memory
        return dx
    return dx + dsource  # dH = dQ W_Q^T + dK W_K^T + dV W_V^T (step 5)
