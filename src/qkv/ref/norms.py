"""Normalisation layers as forward/backward pairs over the last axis (note 000 §5; note 003 on RMSNorm).

Every norm has the signature `forward(params, x, eps) -> (y, cache)`, `backward(dy, cache) -> (dx, grads)`;
params holds "weight" (gamma, (D,)) and, for LayerNorm with bias, "bias" (beta, (D,)).
"""
from __future__ import annotations

from typing import Callable, NamedTuple

import numpy as np

from qkv.ref.functional import Grads
from qkv.registry import Registry


class Norm(NamedTuple):
    forward: Callable
    backward: Callable


NORMS: Registry[Norm] = Registry("norm")


class LayerNormCache(NamedTuple):
    centered: np.ndarray  # x - mu
    var: np.ndarray  # sigma^2 (biased)
    rstd: np.ndarray  # 1 / sqrt(sigma^2 + eps)
    xhat: np.ndarray
    gamma: np.ndarray
    has_bias: bool
    eps: float


def layernorm_forward(params: dict, x: np.ndarray, eps: float):
    """y = gamma * (x - mu) / sqrt(sigma^2 + eps) + beta (000 LLM §3.3.1; 000 §5.1). x (..., D)."""
    mu = x.mean(axis=-1, keepdims=True)  # (..., 1)
    centered = x - mu
    var = (centered ** 2).mean(axis=-1, keepdims=True)  # biased sigma^2, as the note and torch use
    rstd = 1.0 / np.sqrt(var + eps)  # (..., 1)
    xhat = centered * rstd
    y = xhat * params["weight"]
    if "bias" in params:
        y = y + params["bias"]
    return y, LayerNormCache(centered, var, rstd, xhat, params["weight"], "bias" in params, eps)


def layernorm_backward(dy: np.ndarray, cache, grads: Grads) -> np.ndarray:
    """The dmu / dsigma^2 form of 000 LLM §3.3.1, line by line:
        dxhat    = dy * gamma
        dsigma^2 = sum_i dxhat_i (x_i - mu) * (-1/2) (sigma^2 + eps)^(-3/2)
        dmu      = sum_i dxhat_i * (-1 / sqrt(sigma^2 + eps)) + dsigma^2 * (-2/d) sum_i (x_i - mu)
        dx_i     = dxhat_i / sqrt(sigma^2 + eps) + dsigma^2 * 2 (x_i - mu) / d + dmu / d
    The second term of dmu is zero (sum_i (x_i - mu) = 0); it is kept to follow the note.
    Parameter gradients sum over every position (the note's sum index i = 1..d should run over tokens)."""
    centered, var, rstd, xhat, gamma, has_bias, eps = cache
    d = centered.shape[-1]
    dxhat = dy * gamma
    dvar = (dxhat * centered).sum(axis=-1, keepdims=True) * -0.5 * (var + eps) ** -1.5
    dmu = (dxhat * -rstd).sum(axis=-1, keepdims=True) + dvar * (-2.0 / d) * centered.sum(axis=-1, keepdims=True)
    dx = dxhat * rstd + dvar * 2.0 * centered / d + dmu / d
    rows = dy.reshape(-1, d)
    grads.add("weight", (rows * xhat.reshape(-1, d)).sum(axis=0))  # dgamma = sum_t dy_t * xhat_t
    if has_bias:
        grads.add("bias", rows.sum(axis=0))  # dbeta = sum_t dy_t
    return dx


def rmsnorm_forward(params: dict, x: np.ndarray, eps: float):
    """y = gamma * x * r, r = (mean(x^2) + eps)^(-1/2) (note 003: LayerNorm without the mean)."""
    r = 1.0 / np.sqrt((x * x).mean(axis=-1, keepdims=True) + eps)  # (..., 1)
    return params["weight"] * x * r, (x, r, params["weight"])


def rmsnorm_backward(dy: np.ndarray, cache, grads: Grads) -> np.ndarray:
    """dr/dx_j = -r^3 x_j / d, so dx_j = r dxhat_j - r^3 x_j / d * sum_i dxhat_i x_i, dxhat = dy * gamma
    (derived in docs/derivations/rmsnorm.md; the note gives no RMSNorm backward)."""
    x, r, gamma = cache
    d = x.shape[-1]
    dxhat = dy * gamma
    dx = r * dxhat - (r ** 3) * x / d * (dxhat * x).sum(axis=-1, keepdims=True)
    grads.add("weight", (dy * x * r).reshape(-1, d).sum(axis=0))
    return dx


NORMS.register("layernorm")(Norm(layernorm_forward, layernorm_backward))
NORMS.register("rmsnorm")(Norm(rmsnorm_forward, rmsnorm_backward))
