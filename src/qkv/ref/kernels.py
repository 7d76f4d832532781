"""Attention kernels as forward/backward pairs with one signature (as qkv.nn.kernels):

    out, cache = kernel.forward(q, k, v, *, mask, causal, bias, scale)
    dq, dk, dv = kernel.backward(dout, cache)

q (B, H, T, Dh); k, v (B, H, S, Dh) (key/value heads already repeated); mask (B, 1, T, S) bool, True where
allowed, or None; causal applies the bottom-right-aligned triangle; bias a constant broadcastable to
(B, H, T, S) or None. `KERNELS.get(name)(cfg)` builds the kernel a ModelConfig names: the sparse
kinds (note 000 §15.1) are the naive kernel with their pattern ANDed into the mask.
"""
from __future__ import annotations

from typing import Callable, NamedTuple

import numpy as np

from qkv.ref.functional import softmax, softmax_backward
from qkv.registry import Registry


class Kernel(NamedTuple):
    forward: Callable
    backward: Callable


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


def naive_forward(q, k, v, *, mask, causal, bias, scale, pattern=None):
    """A = softmax(Q K^T * scale + bias + M), O = A V (000 LLM §2.2.1 step 3; M = -inf where masked)."""
    T, S = q.shape[-2], k.shape[-2]
    scores = (q @ np.swapaxes(k, -1, -2)) * scale  # S_h = Q_h K_h^T / sqrt(d_k)   (B, H, T, S)
    if bias is not None:
        scores = scores + bias
    allowed = allowed_mask(T, S, mask, causal, pattern)
    if allowed is not None:
        scores = np.where(allowed, scores, -np.inf)
    weights = softmax(scores)  # A_h (B, H, T, S)
    return weights @ v, (q, k, v, weights, scale)  # (B, H, T, Dh)


def naive_backward(dout, cache):
    """000 LLM §3.3.3 steps 1-4, per head:
        dV = A^T dO;  dA = dO V^T;  dS = A * (dA - rowsum(A * dA));  dQ = dS K / sqrt(d_k);  dK = dS^T Q / sqrt(d_k)
    Masked entries have A = 0, so dS = 0 there: the mask needs no separate backward."""
    q, k, v, weights, scale = cache
    dv = np.swapaxes(weights, -1, -2) @ dout  # step 1   (B, H, S, Dh)
    dweights = dout @ np.swapaxes(v, -1, -2)  # step 2   (B, H, T, S)
    dscores = softmax_backward(dweights, weights)  # step 3
    dq = dscores @ k * scale  # step 4   (B, H, T, Dh)
    dk = np.swapaxes(dscores, -1, -2) @ q * scale  # (B, H, S, Dh)
    return dq, dk, dv


def _naive(cfg=None, pattern_fn=None) -> Kernel:
    def forward(q, k, v, *, mask, causal, bias, scale):
        pattern = None if pattern_fn is None else pattern_fn(q.shape[-2], k.shape[-2], cfg)
        return naive_forward(q, k, v, mask=mask, causal=causal, bias=bias, scale=scale, pattern=pattern)

    return Kernel(forward, naive_backward)


KERNELS.register("naive")(_naive)
KERNELS.register("sdpa")(_naive)  # torch's fused kernel computes the same function


# ---- sparse patterns (note 000 §15.1), key s vs query t, both in absolute columns ---------------

def _offsets(T: int, S: int) -> np.ndarray:
    """i - j for query i (at column S - T + t) and key j. (T, S)"""
    return (np.arange(T)[:, None] + (S - T)) - np.arange(S)[None, :]


def local_pattern(T: int, S: int, cfg) -> np.ndarray:
    """|i - j| <= w (000 §15.1.1)."""
    return np.abs(_offsets(T, S)) <= cfg.window


def dilated_pattern(T: int, S: int, cfg) -> np.ndarray:
    """j = i + k * d for integer k (000 §15.1.2), with d = cfg.window."""
    return _offsets(T, S) % max(cfg.window, 1) == 0


def random_pattern(T: int, S: int, cfg, seed: int = 0) -> np.ndarray:
    """Each query sees r = cfg.window keys drawn at random (000 §15.1.3), plus its own column so no
    row is empty. Fixed seed: the pattern is part of the model, the same in every step."""
    rng = np.random.default_rng(seed)
    pattern = np.zeros((T, S), dtype=bool)
    for t in range(T):
        pattern[t, rng.choice(S, size=min(cfg.window, S), replace=False)] = True
    pattern[np.arange(T), np.arange(T) + (S - T)] = True
    return pattern


for _name, _fn in (("local", local_pattern), ("dilated", dilated_pattern), ("random", random_pattern)):
    KERNELS.register(_name)(lambda cfg=None, _fn=_fn: _naive(cfg, _fn))
