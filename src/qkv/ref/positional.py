"""Positional encodings through three hooks with identity defaults, each with its backward.

- `embed_forward(params, x, positions) -> (y, cache)` / `embed_backward(dy, cache, grads) -> dx`
- `rotate_forward(q, k, positions) -> (q, k, cache)` / `rotate_backward(dq, dk, cache) -> (dq, dk)`
- `score_bias(q_positions, k_positions)`: a constant (B, H, T, S) score bias, or None
- `score_bias_forward(params, q, k, q_positions, k_positions) -> (bias, cache)` /
  `score_bias_backward(dbias, cache, grads) -> (dq, dk)`: a learnt or content-dependent bias (qkv.ref.relative;
  q (B, H, T, Dh) after `rotate`, k (B, H, S, Dh) after the K/V head repeat, as in qkv.nn.positional); the
  default wraps `score_bias`, a constant, whose backward is nothing
- `value_bias(params, q_positions, k_positions)`: a `RelativeValues` term for the kernel, or None; its table's
  gradient is stored under `value_param`

`params` are the encoding's own parameters (the model's `positional.*`, prefix stripped), shared by every
layer; every layer adds its share of their gradients under the stack's `positional.*`
(AttentionContext.positional_prefix, qkv.ref.attention).

Positions are (B, T) integer arrays, as in qkv.nn.positional. Tables are float64 here.
"""
from __future__ import annotations

import math

import numpy as np

from qkv.plan import rope_scaling
from qkv.ref.functional import Grads
from qkv.registry import Registry
from qkv.rope_scaling import NO_SCALING, frequencies

POSITIONALS: Registry[type["Positional"]] = Registry("positional encoding")


class Positional:
    """No positional information: every hook is the identity (and so is its backward)."""

    decoder_twin: str | None = None  # as qkv.nn.positional: the encoder-decoder's decoder uses this entry

    def __init__(self, cfg):
        self.cfg = cfg

    def embed_forward(self, params: dict, x: np.ndarray, positions: np.ndarray):
        return x, None

    def embed_backward(self, dy: np.ndarray, cache, grads: Grads) -> np.ndarray:
        return dy

    def rotate_forward(self, q: np.ndarray, k: np.ndarray, positions: np.ndarray):
        return q, k, None

    def rotate_backward(self, dq: np.ndarray, dk: np.ndarray, cache):
        return dq, dk

    def score_bias(self, q_positions: np.ndarray, k_positions: np.ndarray):
        return None

    def score_bias_forward(self, params: dict, q, k, q_positions, k_positions):
        return self.score_bias(q_positions, k_positions), None

    def score_bias_backward(self, dbias: np.ndarray, cache, grads: Grads):
        """(dq, dk) through the bias (None where it does not read them); its tables' gradients go to grads."""
        return None, None  # a constant bias: nothing to differentiate

    value_param = ""

    def value_bias(self, params: dict, q_positions: np.ndarray, k_positions: np.ndarray):
        return None


POSITIONALS.register("none")(Positional)


def sinusoid_angles(positions: np.ndarray, dim: int, base: float) -> np.ndarray:
    """angle[pos, i] = pos / base^(2i/dim), i < dim/2 (note 000 §3.1). (..., dim/2)"""
    inv_freq = base ** (-np.arange(0, dim, 2, dtype=np.float64) / dim)
    return positions.astype(np.float64)[..., None] * inv_freq


def sinusoidal_table(positions: np.ndarray, dim: int, base: float = 10000.0) -> np.ndarray:
    """PE(pos, 2i) = sin(pos / 10000^(2i/d)), PE(pos, 2i+1) = cos(...) (note 000 §3.1.1). (..., dim)"""
    angles = sinusoid_angles(positions, dim, base)
    return np.stack((np.sin(angles), np.cos(angles)), axis=-1).reshape(*angles.shape[:-1], -1)[..., :dim]


@POSITIONALS.register("sinusoidal")
class Sinusoidal(Positional):
    def embed_forward(self, params, x, positions):  # a constant added: dx = dy, no parameters
        return x + sinusoidal_table(positions, self.cfg.d_model), None


@POSITIONALS.register("learned")
class Learned(Positional):
    """H0 = E + P[positions]; dP = dH0 scattered onto the rows used (000 LLM §3.5: "dL/dP = dL/dH^0")."""

    def embed_forward(self, params, x, positions):
        return x + params["weight"][positions], (positions, params["weight"].shape)

    def embed_backward(self, dy, cache, grads):
        positions, shape = cache
        dweight = np.zeros(shape, dtype=dy.dtype)
        np.add.at(dweight, positions.reshape(-1), dy.reshape(-1, shape[1]))  # scatter-add, as for W_E
        grads.add("weight", dweight)
        return dy


def rotate_half(x: np.ndarray) -> np.ndarray:
    """R(x1, x2) = (-x2, x1) on the pairs (i, i + Dh/2): the 90-degree turn of each 2x2 block."""
    x1, x2 = np.split(x, 2, axis=-1)
    return np.concatenate((-x2, x1), axis=-1)


@POSITIONALS.register("rope")
class Rotary(Positional):
    """RoPE (note 003): x~ = x cos(m theta) + R(x) sin(m theta) per pair, in the rotate-half layout of
    qkv.nn.positional.Rotary, theta as model.rope_scaling stretches it (qkv.rope_scaling). The map is a rotation
    R_m, so its backward is R_m^T = R_{-m}: rotation by -theta, dx = dy cos - R(dy) sin (docs/derivations/rope.md;
    YaRN's factor scales both)."""

    def _cos_sin(self, positions):
        scaling = rope_scaling(self.cfg) if hasattr(self.cfg, "rope_scaling") else NO_SCALING  # (a bare cfg: none)
        theta, m = frequencies(self.cfg.head_dim, self.cfg.rope_theta, scaling, getattr(self.cfg, "rope_dims", 0),
                               int(positions.max()) + 1 if positions.size else 0)  # (Dh/2,), m; 0 past rope_dims
        angles = positions.astype(np.float64)[..., None] * theta  # (B, T, Dh/2)
        angles = np.concatenate((angles, angles), axis=-1)[:, None]  # (B, 1, T, Dh)
        return m * np.cos(angles), m * np.sin(angles)  # m: YaRN's factor (docs/derivations/rope_scaling.md)

    def rotate_forward(self, q, k, positions):
        cos, sin = self._cos_sin(positions)
        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin, (cos, sin)

    def rotate_backward(self, dq, dk, cache):
        cos, sin = cache  # rotation by -theta: cos(-t) = cos t, sin(-t) = -sin t
        return dq * cos - rotate_half(dq) * sin, dk * cos - rotate_half(dk) * sin


def alibi_slopes(n_heads: int) -> np.ndarray:
    """Head slopes 2^(-8h/H) (Press et al. 2022), with their rule for H not a power of two."""
    closest = 2 ** math.floor(math.log2(n_heads))
    slopes = [2 ** (-8 * (h + 1) / closest) for h in range(closest)]
    extra = [2 ** (-4 * (2 * h + 1) / closest) for h in range(n_heads - closest)]
    return np.array(slopes + extra)


@POSITIONALS.register("alibi")
class ALiBi(Positional):
    """score_ij -= m_h |i - j| (beyond the notes): a constant bias, so it adds nothing to the backward."""

    def score_bias(self, q_positions, k_positions):
        distance = np.abs(q_positions[:, :, None] - k_positions[:, None, :]).astype(np.float64)  # (B, T, S)
        return -alibi_slopes(self.cfg.n_heads)[None, :, None, None] * distance[:, None]  # (B, H, T, S)

