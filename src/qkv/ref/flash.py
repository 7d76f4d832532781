"""Tiled flash attention, forward and backward (note 002, "Flash Attention": tiling, online softmax,
recomputation; Dao et al. 2022, Algorithms 1-2).

Forward: for each query tile, sweep the key tiles keeping a running row max m, running sum l and an
unnormalised output; when a new tile raises the max, rescale what came before by exp(m_old - m_new).
Only O (the output) and the log-sum-exp L = m + log l ((B, H, T), O(n)) are saved.
Backward: recompute each tile's probabilities P = exp(S - L) from the saved L, and apply the same
formulas as the naive kernel (000 LLM §3.3.3) tile by tile, with rowsum(A * dA) = rowsum(dO * O) =: D.
Extra memory beyond inputs and outputs: L and D, O(n), plus one (Br, Bc) tile (and dS itself, O(n^2),
when a learnt score bias needs its gradient). Shaw's value term is linear in A: each tile adds C(P) table
to the unnormalised output, and its gather joins dP in the backward.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

from qkv.ref.kernels import KERNELS, Kernel, KernelGrads, RelativeValues

BLOCK = 64  # tile edge (Br = Bc); small tiles keep the working set in cache


class FlashCache(NamedTuple):
    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    out: np.ndarray  # O (B, H, T, Dh)
    lse: np.ndarray  # L = logsumexp of each row (B, H, T): all the backward keeps of A
    mask: np.ndarray | None
    causal: bool
    bias: np.ndarray | None
    scale: float
    block: int
    value_bias: RelativeValues | None


def _tile_scores(q_tile, k_tile, scale, bias, mask, causal, rows, cols, T, S):
    """S_ij = Q_i K_j^T * scale (+ bias, -inf where masked) for one tile. (B, H, Br, Bc)"""
    scores = (q_tile @ np.swapaxes(k_tile, -1, -2)) * scale
    if bias is not None:
        scores = scores + np.broadcast_to(bias, bias.shape[:-2] + (T, S))[..., rows, cols]
    if mask is not None:
        scores = np.where(mask[..., rows, cols], scores, -np.inf)
    elif causal:  # the triangle from the tile's indices: no (T, S) array is ever built
        query_cols = np.arange(rows.start, rows.stop)[:, None] + (S - T)
        scores = np.where(np.arange(cols.start, cols.stop)[None, :] <= query_cols, scores, -np.inf)
    return scores


def _tiles(n: int, size: int):
    return [slice(start, min(start + size, n)) for start in range(0, n, size)]


def flash_forward(q, k, v, *, mask, causal, bias, scale, value_bias=None, block: int = BLOCK):
    """Online softmax over key tiles; returns O (B, H, T, Dh) and caches L = logsumexp (B, H, T)."""
    T, S = q.shape[-2], k.shape[-2]
    out = np.zeros(q.shape[:-1] + (v.shape[-1],), dtype=q.dtype)
    lse = np.empty(q.shape[:-1], dtype=q.dtype)
    for rows in _tiles(T, block):
        m = np.full(q.shape[:-2] + (rows.stop - rows.start, 1), -np.inf, dtype=q.dtype)  # running max
        l = np.zeros_like(m)  # running sum of exp(s - m)
        acc = np.zeros(q.shape[:-2] + (rows.stop - rows.start, v.shape[-1]), dtype=q.dtype)
        for cols in _tiles(S, block):
            s = _tile_scores(q[..., rows, :], k[..., cols, :], scale, bias, mask, causal, rows, cols, T, S)
            m_new = np.maximum(m, s.max(axis=-1, keepdims=True))
            m_safe = np.where(np.isfinite(m_new), m_new, 0.0)  # a row masked so far stays at l = 0
            p = np.exp(s - m_safe)  # (B, H, Br, Bc)
            rescale = np.exp(np.where(np.isfinite(m), m, -np.inf) - m_safe)  # exp(m_old - m_new)
            l = rescale * l + p.sum(axis=-1, keepdims=True)
            acc = rescale * acc + p @ v[..., cols, :]
            if value_bias is not None:  # linear in A, so it is rescaled with the rest: + C(P) table
                acc = acc + _value_tile(value_bias, rows, cols).buckets(p) @ value_bias.table
            m = m_new
        out[..., rows, :] = acc / l
        lse[..., rows] = (m + np.log(l))[..., 0]
    return out, FlashCache(q, k, v, out, lse, mask, causal, bias, scale, block, value_bias)


def _value_tile(value_bias: RelativeValues, rows: slice, cols: slice) -> RelativeValues:
    return RelativeValues(value_bias.index[:, rows, cols], value_bias.table)


def flash_backward(dout, cache):
    """Per tile: P = exp(S - L); dV_j += P^T dO_i; dP = dO_i V_j^T; dS = P * (dP - D_i);
    dQ_i += dS K_j * scale; dK_j += dS^T Q_i * scale, with D = rowsum(dO * O) (000 LLM §3.3.3, tiled)."""
    q, k, v, out, lse, mask, causal, bias, scale, block, value_bias = cache
    T, S = q.shape[-2], k.shape[-2]
    dq, dk, dv = np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)
    # a learnt bias needs dS itself: (B, H, T, S), so O(n^2) memory only when there is a bias
    dtable = None if value_bias is None else np.zeros_like(value_bias.table)
    dbias = None if bias is None else np.zeros(np.broadcast_shapes(q.shape[:-2], bias.shape[:-2]) + (T, S))
    rowdot = (dout * out).sum(axis=-1)  # D_i = rowsum(A * dA) = rowsum(dO * O)   (B, H, T)
    for rows in _tiles(T, block):
        for cols in _tiles(S, block):
            s = _tile_scores(q[..., rows, :], k[..., cols, :], scale, bias, mask, causal, rows, cols, T, S)
            p = np.exp(s - lse[..., rows, None])  # recomputed A tile   (B, H, Br, Bc)
            dv[..., cols, :] += np.swapaxes(p, -1, -2) @ dout[..., rows, :]
            dp = dout[..., rows, :] @ np.swapaxes(v[..., cols, :], -1, -2)
            if value_bias is not None:  # D_i = rowsum(dO * O) still holds: O includes the value term
                dp_rel, dtable_tile = _value_tile(value_bias, rows, cols).backward(dout[..., rows, :], p)
                dp, dtable = dp + dp_rel, dtable + dtable_tile
            ds = p * (dp - rowdot[..., rows, None])
            dq[..., rows, :] += ds @ k[..., cols, :] * scale
            dk[..., cols, :] += np.swapaxes(ds, -1, -2) @ q[..., rows, :] * scale
            if dbias is not None:
                dbias[..., rows, cols] = ds
    return KernelGrads(dq, dk, dv, dbias, dtable)


KERNELS.register("flash")(lambda cfg=None: Kernel(flash_forward, flash_backward))
