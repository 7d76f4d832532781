"""Position-wise feed-forward networks, forward and backward (000 LLM §2.2.2, §3.3.2; note 003 on SwiGLU).

Every FFN has the signature `forward(params, x, activation) -> (y, cache)`, `backward(dy, cache) -> (dx, grads)`,
with the parameter names of qkv.nn.ffn: up_proj, down_proj (and gate_proj for the GLU family).
"""
from __future__ import annotations

from typing import Callable, NamedTuple

import numpy as np

from qkv.ref.functional import (Grads, activation_backward, activation_forward, linear_backward,
                                linear_forward, scope)
from qkv.registry import Registry


class FFN(NamedTuple):
    forward: Callable
    backward: Callable


FFNS: Registry[FFN] = Registry("ffn")


def mlp_forward(params: dict, x: np.ndarray, activation: str):
    """FFN(x) = act(x W1 + b1) W2 + b2 (000 LLM §2.2.2 steps 1-3). x (B, T, D) -> (B, T, D)."""
    a1, c1 = linear_forward(x, **scope(params, "up_proj"))  # A1 (B, T, F)
    a2, cact = activation_forward(a1, activation)  # A2 = act(A1)
    y, c2 = linear_forward(a2, **scope(params, "down_proj"))
    return y, (c1, cact, c2)


def mlp_backward(dy: np.ndarray, cache, grads: Grads) -> np.ndarray:
    """000 LLM §3.3.2: dW2 = A2^T dC, db2 = sum_t dC_t, dA2 = dC W2^T; dA1 = dA2 * act'(A1)
    (the ReLU mask I(A1 > 0) for ReLU); dW1 = Z^T dA1, db1 = sum_t dA1_t, dZ = dA1 W1^T."""
    c1, cact, c2 = cache
    da2 = linear_backward(dy, c2, grads.scope("down_proj"))
    return linear_backward(activation_backward(da2, cact), c1, grads.scope("up_proj"))


class GLUCache(NamedTuple):
    gate_proj: tuple  # linear_forward's caches
    up_proj: tuple
    activation: tuple
    down_proj: tuple
    act: np.ndarray  # act(x W_gate)   (B, T, F)
    up: np.ndarray  # x W_up   (B, T, F)


def glu_forward(params: dict, x: np.ndarray, activation: str):
    """FFN(x) = (act(x W_gate) * (x W_up)) W_down (note 003: SwiGLU for act = SiLU)."""
    gate, cg = linear_forward(x, **scope(params, "gate_proj"))  # (B, T, F)
    up, cu = linear_forward(x, **scope(params, "up_proj"))  # (B, T, F)
    act, cact = activation_forward(gate, activation)
    y, cd = linear_forward(act * up, **scope(params, "down_proj"))
    return y, GLUCache(cg, cu, cact, cd, act, up)


def glu_backward(dy: np.ndarray, cache, grads: Grads) -> np.ndarray:
    """Product rule on h = act(g) * u: du = dh * act(g), dg = dh * u * act'(g); both branches add into dx."""
    cg, cu, cact, cd, act, up = cache
    dh = linear_backward(dy, cd, grads.scope("down_proj"))
    dx_up = linear_backward(dh * act, cu, grads.scope("up_proj"))
    dx_gate = linear_backward(activation_backward(dh * up, cact), cg, grads.scope("gate_proj"))
    return dx_up + dx_gate


FFNS.register("mlp")(FFN(mlp_forward, mlp_backward))
FFNS.register("glu")(FFN(glu_forward, glu_backward))


LIMIT, ALPHA = 7.0, 1.702  # qkv.nn.ffn.ClampedGLU's (gpt-oss's)


def clamped_glu_forward(params: dict, x: np.ndarray, activation: str):
    """gpt-oss's SwiGLU: g = min(x W_g, l), u = clip(x W_u, -l, l), h = (u + 1) g sigma(alpha g), y = h W_d."""
    g_raw, cg = linear_forward(x, **scope(params, "gate_proj"))
    u_raw, cu = linear_forward(x, **scope(params, "up_proj"))
    g, u = np.minimum(g_raw, LIMIT), np.clip(u_raw, -LIMIT, LIMIT)
    sig = 1.0 / (1.0 + np.exp(-ALPHA * g))
    hidden = (u + 1) * g * sig
    y, cd = linear_forward(hidden, **scope(params, "down_proj"))
    return y, (cg, cu, cd, g_raw, u_raw, g, u, sig)


def clamped_glu_backward(dy: np.ndarray, cache, grads: Grads) -> np.ndarray:
    """dh = dy W_d; du = dh g sigma(alpha g) where |u| < l (the clip's slope, 0 outside); dg = dh (u + 1)
    (sigma(alpha g) + alpha g sigma (1 - sigma)) where g < l (the product rule and sigma' = sigma (1 - sigma))."""
    cg, cu, cd, g_raw, u_raw, g, u, sig = cache
    dh = linear_backward(dy, cd, grads.scope("down_proj"))
    du = dh * g * sig * (np.abs(u_raw) < LIMIT)
    dg = dh * (u + 1) * (sig + ALPHA * g * sig * (1 - sig)) * (g_raw < LIMIT)
    return linear_backward(dg, cg, grads.scope("gate_proj")) + linear_backward(du, cu, grads.scope("up_proj"))


FFNS.register("glu_clamped")(FFN(clamped_glu_forward, clamped_glu_backward))
