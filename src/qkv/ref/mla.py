"""Multi-head latent attention, forward and backward (DeepSeek-V2 §2.1; derived in docs/derivations/mla.md), in the
training form: each head's keys and values made from the latent, then attention as 000 LLM §2.2.1 does it.

    q = c' W_UQ^T, c' = RMSNorm(x W_DQ^T)   (or q = x W_Q^T)      split per head: [q^N ; q^R]
    [c~ ; k^R] = x [W_DKV ; W_KR]^T;  c = RMSNorm(c~)
    [k^N_h ; v_h] = c [W_UK,h ; W_UV,h]^T                          per head, from the one latent
    k_h = [k^N_h ; RoPE(k^R)],  q_h = [q^N_h ; RoPE(q^R_h)]         k^R shared by every head
    o_h = Attention(q_h, k_h, v_h);  y = [o_1 ... o_H] W_O^T

Backward, step by step in reverse (the notes' rules for each piece): W_O and the kernel as attention.md; the keys'
gradient splits into its nope part (to W_UK) and its RoPE part, which every head's copy of k^R sends back, so
dk^R = sum_h dk^R_h (the adjoint of a broadcast is a sum, as GQA's repeat_kv); RoPE's backward is the rotation by
-theta (rope.md); [dk^N_h ; dv_h] merged go back through W_UK,W_UV (linear.md) into dc, the latent's RMSNorm
(rmsnorm.md), then with dk^R through [W_DKV ; W_KR] into dx; the queries likewise through W_UQ, their norm and
W_DQ; dx is the sum of both paths. The torch engine (qkv.nn.mla) computes the same per-head form without a cache
and the absorbed form, the paper's decoding one, into its latent cache.
Parameter names: qkv.nn.mla.LatentAttention's (q_a_proj, q_a_norm, q_b_proj or q_proj; kv_a_proj, kv_a_norm,
kv_b_proj, o_proj).
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

from qkv.ref.attention import AttentionContext, merge_heads, split_heads
from qkv.ref.functional import Grads, linear_backward, linear_forward, scope
from qkv.ref.norms import rmsnorm_backward, rmsnorm_forward


class LatentCache(NamedTuple):
    q_path: tuple  # (q_a cache, q_a_norm cache, q_b cache) or (q_proj cache,)
    kv_a: tuple
    kv_norm: tuple
    kv_b: tuple
    rotation: object
    kernel: object
    o_proj: tuple
    ctx: AttentionContext
    sizes: tuple  # (H, d_N, d_R, d_V, r)


def sizes_of(params: dict, heads: int) -> tuple[int, int, int, int, int]:
    """(H, d_N, d_R, d_V, r) from the parameters' shapes."""
    r = params["kv_a_norm.weight"].shape[0]
    d_r = params["kv_a_proj.weight"].shape[0] - r
    q_rows = (params["q_b_proj.weight"] if "q_b_proj.weight" in params else params["q_proj.weight"]).shape[0]
    d_n = q_rows // heads - d_r
    d_v = params["kv_b_proj.weight"].shape[0] // heads - d_n
    return heads, d_n, d_r, d_v, r


def latent_forward(params: dict, x: np.ndarray, ctx: AttentionContext, memory=None):
    """x (B, T, D) -> (B, T, D)."""
    H, d_n, d_r, d_v, r = sizes = sizes_of(params, ctx.n_heads)
    if "q_b_proj.weight" in params:
        a, c1 = linear_forward(x, **scope(params, "q_a_proj"))  # x W_DQ^T
        a, c2 = rmsnorm_forward(scope(params, "q_a_norm"), a, ctx.norm_eps)
        q, c3 = linear_forward(a, **scope(params, "q_b_proj"))  # c' W_UQ^T
        q_path = (c1, c2, c3)
    else:
        q, c3 = linear_forward(x, **scope(params, "q_proj"))
        q_path = (c3,)
    q = split_heads(q, H)  # (B, H, T, d_N + d_R)
    kv, c4 = linear_forward(x, **scope(params, "kv_a_proj"))  # [c~ ; k^R] (B, T, r + d_R)
    latent, c5 = rmsnorm_forward(scope(params, "kv_a_norm"), kv[..., :r], ctx.norm_eps)  # c (B, T, r)
    up, c6 = linear_forward(latent, **scope(params, "kv_b_proj"))  # (B, T, H (d_N + d_V))
    up = split_heads(up, H)
    k_nope, v = up[..., :d_n], up[..., d_n:]  # (B, H, T, d_N), (B, H, T, d_V)
    q_rope, k_rope, crot = ctx.positional.rotate_forward(q[..., d_n:], kv[:, None, :, r:], ctx.positions)
    q = np.concatenate((q[..., :d_n], q_rope), axis=-1)
    k = np.concatenate((k_nope, np.broadcast_to(k_rope, (*k_nope.shape[:-1], d_r))), axis=-1)  # k^R in every head
    heads, ckern = ctx.kernel.forward(q, k, v, mask=ctx.mask, causal=ctx.causal, bias=None,
                                      scale=ctx.scale or (d_n + d_r) ** -0.5)  # (B, H, T, d_V)
    y, co = linear_forward(merge_heads(heads), **scope(params, "o_proj"))
    return y, LatentCache(q_path, c4, c5, c6, crot, ckern, co, ctx, sizes)


def latent_backward(dy: np.ndarray, cache: LatentCache, grads: Grads) -> np.ndarray:
    ctx = cache.ctx
    H, d_n, d_r, d_v, r = cache.sizes
    dmerged = linear_backward(dy, cache.o_proj, grads.scope("o_proj"))
    dq, dk, dv, _, _ = ctx.kernel.backward(split_heads(dmerged, H), cache.kernel)
    dk_rope = dk[..., d_n:].sum(axis=1, keepdims=True)  # every head's copy of k^R: the broadcast's adjoint
    dq_rope, dk_rope = ctx.positional.rotate_backward(dq[..., d_n:], dk_rope, cache.rotation)
    dup = merge_heads(np.concatenate((dk[..., :d_n], dv), axis=-1))  # d[k^N ; v] (B, T, H (d_N + d_V))
    dlatent = linear_backward(dup, cache.kv_b, grads.scope("kv_b_proj"))
    dkv = np.concatenate((rmsnorm_backward(dlatent, cache.kv_norm, grads.scope("kv_a_norm")), dk_rope[:, 0]), axis=-1)
    dx = linear_backward(dkv, cache.kv_a, grads.scope("kv_a_proj"))
    dq = merge_heads(np.concatenate((dq[..., :d_n], dq_rope), axis=-1))
    if len(cache.q_path) == 3:
        c1, c2, c3 = cache.q_path
        da = rmsnorm_backward(linear_backward(dq, c3, grads.scope("q_b_proj")), c2, grads.scope("q_a_norm"))
        return dx + linear_backward(da, c1, grads.scope("q_a_proj"))
    return dx + linear_backward(dq, cache.q_path[0], grads.scope("q_proj"))
