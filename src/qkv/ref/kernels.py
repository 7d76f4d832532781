"""Attention kernels as forward/backward pairs with one signature (as qkv.nn.kernels):

    out, cache = kernel.forward(q, k, v, *, mask, causal, bias, scale, value_bias=None)
    dq, dk, dv, dbias, dvalue_table = kernel.backward(dout, cache)     # a KernelGrads

q (B, H, T, Dh); k, v (B, H, S, Dh) (key/value heads already repeated); mask (B, 1, T, S) bool, True where
allowed, or None; causal applies the bottom-right-aligned triangle; bias broadcastable to (B, H, T, S) or
None, whose gradient dbias (= dscores, (B, H, T, S)) the backward returns for the learnt biases (T5, Shaw,
Transformer-XL; None without a bias); value_bias a `RelativeValues` term out_i += sum_j A_ij table[index_ij]
(Shaw's a^V_ij), or None. `KERNELS.get(name)(cfg)` builds the kernel a ModelConfig names: the sparse kinds
(note 000 §15.1) are the naive kernel with their pattern ANDed into the mask.
"""
from __future__ import annotations

from typing import Callable, NamedTuple

import numpy as np

from qkv.ref.functional import softmax, softmax_backward
from qkv.registry import Registry


class Kernel(NamedTuple):
    forward: Callable
    backward: Callable
    full: bool = True  # softmax over every allowed key (as qkv.nn.kernels.KernelSpec.full): cross-attention needs it


class KernelGrads(NamedTuple):
    dq: np.ndarray  # (B, H, T, Dh)
    dk: np.ndarray  # (B, H, S, Dh)
    dv: np.ndarray  # (B, H, S, Dh)
    dbias: np.ndarray | None = None  # dL/d(score bias) (B, H, T, S), None when the forward had no bias
    dvalue_table: np.ndarray | None = None  # dL/d(value table) (R, Dh), None without a value term


class RelativeValues(NamedTuple):
    """out_i += sum_j A_ij table[index_ij] (Shaw et al. 2018: z_i = sum_j a_ij (v_j + a^V_ij)), as
    qkv.nn.kernels.RelativeValues. Through the buckets C_ir = sum_j A_ij [index_ij = r]: term = C table."""

    index: np.ndarray  # (B, T, S) int: the table row key j adds to query i
    table: np.ndarray  # (R, Dh)

    def buckets(self, weights: np.ndarray) -> np.ndarray:
        """C (B, H, T, R) = A onehot(index): a scatter-add of the weights onto the table rows."""
        onehot = (self.index[..., None] == np.arange(self.table.shape[0])).astype(weights.dtype)  # (B, T, S, R)
        return np.einsum("bhts,btsr->bhtr", weights, onehot)

    def backward(self, dout: np.ndarray, weights: np.ndarray):
        """term = C table: dtable = C^T dO (summed over B, H, T); dA_ij = dO_i . table[index_ij] (a gather)."""
        dtable = np.einsum("bhtr,bhtd->rd", self.buckets(weights), dout)
        per_row = dout @ self.table.T  # dO_i . table_r   (B, H, T, R)
        index = np.broadcast_to(self.index[:, None], weights.shape)  # (B, H, T, S)
        return np.take_along_axis(per_row, index, axis=-1), dtable


KERNELS: Registry[Callable[..., Kernel]] = Registry("attention kernel")


def causal_mask(T: int, S: int) -> np.ndarray:
    """M[t, s] = s <= S - T + t: the lower triangle aligned to the bottom-right corner (000 §8.2.1). (T, S)"""
    return np.arange(S)[None, :] <= np.arange(T)[:, None] + (S - T)


def allowed_mask(T: int, S: int, mask, causal: bool, pattern=None):
    """Everything that restricts the keys, combined into one bool (.., T, S) array, or None."""
    if mask is None and causal:
        mask = causal_mask(T, S)
    if pattern is not None:
        mask = pattern if mask is None else mask & pattern
    return mask


class NaiveCache(NamedTuple):
    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    weights: np.ndarray  # A (B, H, T, S)
    scale: float
    has_bias: bool  # a score bias was added: its gradient dS is returned
    value_bias: RelativeValues | None
    scores: np.ndarray  # S = Q K^T * scale + bias, before the mask (B, H, T, S): what `qkv explain` shows
    allowed: np.ndarray | None  # the mask M as bool (.., T, S), True where attention is allowed; None: all
    capped: np.ndarray | None = None  # tanh(S / c) of soft-capped scores (Gemma 2), or None


def naive_forward(q, k, v, *, mask, causal, bias, scale, pattern=None, value_bias=None, softcap: float = 0.0):
    """A = softmax(Q K^T * scale + bias + M), O = A V (+ the value term) (000 LLM §2.2.1 step 3; M = -inf
    where masked). `softcap` c > 0: the scores are c tanh(S / c) before the mask (Gemma 2), whose backward
    multiplies dS by 1 - tanh^2(S / c)."""
    T, S = q.shape[-2], k.shape[-2]
    scores = (q @ np.swapaxes(k, -1, -2)) * scale  # S_h = Q_h K_h^T / sqrt(d_k)   (B, H, T, S)
    if bias is not None:
        scores = scores + bias
    capped = None
    if softcap:
        capped = np.tanh(scores / softcap)
        scores = softcap * capped
    allowed = allowed_mask(T, S, mask, causal, pattern)
    masked = scores if allowed is None else np.where(allowed, scores, -np.inf)
    weights = softmax(masked)  # A_h (B, H, T, S)
    out = weights @ v  # (B, H, T, Dh)
    if value_bias is not None:
        out = out + value_bias.buckets(weights) @ value_bias.table  # + sum_j A_ij a^V_ij
    return out, NaiveCache(q, k, v, weights, scale, bias is not None, value_bias, scores, allowed, capped)


class NaiveSteps(NamedTuple):
    """naive_backward's intermediate gradients, each (B, H, ., .): what `qkv explain` shows."""

    dv: np.ndarray  # A^T dO   (S, Dh)
    dweights: np.ndarray  # dA = dO V^T (+ the value term's gather)   (T, S)
    dscores: np.ndarray  # dS = A * (dA - rowsum(A * dA))   (T, S)
    dq: np.ndarray  # dS K / sqrt(d_k)   (T, Dh)
    dk: np.ndarray  # dS^T Q / sqrt(d_k)   (S, Dh)
    dtable: np.ndarray | None  # the value table's gradient, or None


def naive_backward(dout, cache):
    return kernel_grads(naive_steps(dout, cache), cache)


def kernel_grads(steps: "NaiveSteps", cache: NaiveCache) -> KernelGrads:
    """What the layer needs of the steps: dq, dk, dv, and dS as the score bias's gradient when there is one."""
    return KernelGrads(steps.dq, steps.dk, steps.dv, steps.dscores if cache.has_bias else None, steps.dtable)


def naive_steps(dout, cache: NaiveCache) -> NaiveSteps:
    """000 LLM §3.3.3 steps 1-4, per head:
        dV = A^T dO;  dA = dO V^T;  dS = A * (dA - rowsum(A * dA));  dQ = dS K / sqrt(d_k);  dK = dS^T Q / sqrt(d_k)
    Masked entries have A = 0, so dS = 0 there: the mask needs no separate backward.
    A score bias receives dS itself; a value term adds its gather to dA (RelativeValues.backward)."""
    q, k, v, weights, scale, value_bias = cache.q, cache.k, cache.v, cache.weights, cache.scale, cache.value_bias
    dv = np.swapaxes(weights, -1, -2) @ dout  # step 1   (B, H, S, Dh)
    dweights = dout @ np.swapaxes(v, -1, -2)  # step 2   (B, H, T, S)
    dtable = None
    if value_bias is not None:
        dweights_rel, dtable = value_bias.backward(dout, weights)
        dweights = dweights + dweights_rel
    dscores = softmax_backward(dweights, weights)  # step 3
    if cache.capped is not None:  # d(c tanh(S / c)) / dS = 1 - tanh^2(S / c)
        dscores = dscores * (1 - cache.capped ** 2)
    dq = dscores @ k * scale  # step 4   (B, H, T, Dh)
    dk = np.swapaxes(dscores, -1, -2) @ q * scale  # (B, H, S, Dh)
    return NaiveSteps(dv, dweights, dscores, dq, dk, dtable)


def _naive(cfg=None, pattern_fn=None) -> Kernel:
    def forward(q, k, v, *, mask, causal, bias, scale, value_bias=None, softcap: float = 0.0):
        pattern = None if pattern_fn is None else pattern_fn(q.shape[-2], k.shape[-2], cfg, mask)
        return naive_forward(q, k, v, mask=mask, causal=causal, bias=bias, scale=scale, pattern=pattern,
                             value_bias=value_bias, softcap=softcap)

    return Kernel(forward, naive_backward)


KERNELS.register("naive")(_naive)
KERNELS.register("sdpa")(_naive)  # torch's fused kernel computes the same function


# ---- sparse patterns (note 000 §15.1), key s vs query t, both in absolute columns ---------------

def _offsets(T: int, S: int) -> np.ndarray:
    """i - j for query i (at column S - T + t) and key j. (T, S)"""
    return (np.arange(T)[:, None] + (S - T)) - np.arange(S)[None, :]


def local_pattern(T: int, S: int, cfg, mask=None) -> np.ndarray:
    """|i - j| <= w (000 §15.1.1)."""
    return np.abs(_offsets(T, S)) <= cfg.window


def dilated_pattern(T: int, S: int, cfg, mask=None) -> np.ndarray:
    """j = i + k * d for integer k (000 §15.1.2), with d = cfg.window."""
    return _offsets(T, S) % max(cfg.window, 1) == 0


GLOBAL_KEYS = 2  # BigBird's global tokens (qkv.nn.sparse.GLOBAL_KEYS)
# qkv.nn.sparse draws RANDOM_KEYS = 3 distances as torch.randperm(32, seed 0)[:3] + w + 1; NumPy cannot
# replay torch's generator, so the draw is written down (tests/ref/test_kernels.py checks it against torch)
RANDOM_OFFSETS = (12, 25, 31)


def random_pattern(T: int, S: int, cfg, mask=None) -> np.ndarray:
    """BigBird-style, as qkv.nn.sparse.random (000 §15.1.3 "r random positions per query"): the window
    |i - j| <= w, keys at the fixed random distances w + 1 + RANDOM_OFFSETS (both directions), and the first
    GLOBAL_KEYS keys the query may see (columns 0..G-1, or with a padding mask the first G allowed ones of
    each row). A function of distances, so padding and cached decoding see the same keys. (T, S) or (B, 1, T, S)"""
    distance = np.abs(_offsets(T, S))
    near = (distance <= cfg.window) | np.isin(distance, np.array(RANDOM_OFFSETS) + cfg.window + 1)
    if mask is None:
        return near | (np.arange(S)[None, :] < GLOBAL_KEYS)
    allowed = np.broadcast_to(mask, mask.shape[:-2] + (T, S))
    return near | (allowed & (np.cumsum(allowed, axis=-1) <= GLOBAL_KEYS))


for _name, _fn in (("local", local_pattern), ("dilated", dilated_pattern), ("random", random_pattern)):
    KERNELS.register(_name)(lambda cfg=None, _fn=_fn: _naive(cfg, _fn)._replace(full=False))
