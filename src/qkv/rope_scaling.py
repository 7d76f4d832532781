"""RoPE's frequencies as the long-context models stretch them (docs/derivations/rope-scaling.md).

Note 003's RoPE rotates pair i of a head by pos * theta_i, theta_i = base^(-2i/Dh). A model trained on a
context of L positions has seen pair i turn through at most L theta_i radians; the pairs whose wavelength
lambda_i = 2 pi / theta_i exceeds L never completed a turn, and positions past L give them angles they never
saw. Each scaling keeps the fast pairs (short wavelengths: local order) and slows the slow ones by the
context's stretch s, so that s L positions map into angles the model knows:

    linear   theta_i / s for every pair (position interpolation, Chen et al. 2023)
    llama3   theta_i where lambda_i < L / high; theta_i / s where lambda_i > L / low; between, the
             interpolation (1 - a) theta_i / s + a theta_i, a = (L / lambda_i - low) / (high - low) (Llama 3.1)
    yarn     theta_i blended with theta_i / s by a ramp over the pairs that turn between beta_slow and beta_fast
             times in L positions, and cos, sin scaled by m = 0.1 ln s + 1 (Peng et al. 2023, "YaRN")
    longrope theta_i / f_i with a searched divisor f_i per pair (Ding et al. 2024, "LongRoPE"; Phi-3 128k): the
             short set while a forward's positions stay within L, the long set past it (transformers switches
             per call so; llama.cpp by the context it is given: docs/DEVIATIONS.md), cos, sin scaled by a given m

`frequencies(head_dim, base, scaling)` returns (theta (Dh/2,) float64, m): what both engines' Rotary turn by
(plain NumPy: the torch engine takes the array, the reference engine uses it as it is).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from qkv.errors import QkvError

SCALINGS = ("none", "linear", "llama3", "yarn", "longrope")  # model.rope_scaling


@dataclass(frozen=True)
class RopeScaling:
    """model.rope_* as one value: how a Rotary encoding's frequencies are stretched."""

    kind: str = "none"
    factor: float = 1.0  # s
    original_context: int = 0  # L
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    long_factors: tuple[float, ...] = ()  # longrope: f_i past L
    short_factors: tuple[float, ...] = ()  # longrope: f_i within L
    attention_factor: float = 1.0  # longrope: m
    yarn_mscale: float = 0.0  # yarn: m where set (DeepSeek's mscale / mscale_all_dim ratio); 0: 0.1 ln s + 1
    yarn_truncate: bool = True  # yarn: the ramp's ends rounded out to whole pairs (the paper's code; gpt-oss: not)

    def check(self) -> "RopeScaling":
        if self.kind not in SCALINGS:
            raise QkvError(f"model.rope_scaling={self.kind!r} is not a RoPE scaling qkv knows; "
                           f"choose from: {', '.join(SCALINGS)}")
        if self.kind == "longrope" and not (self.long_factors and len(self.long_factors) == len(self.short_factors)
                                            and min(self.long_factors + self.short_factors) > 0):
            raise QkvError("model.rope_scaling='longrope' needs model.rope_long_factors and rope_short_factors, "
                           "one positive divisor a turned pair each")
        if self.kind in ("llama3", "yarn", "longrope") and self.original_context < 1:
            raise QkvError(f"model.rope_scaling={self.kind!r} needs model.rope_original_context >= 1")
        if self.kind == "llama3" and not self.high_freq_factor > self.low_freq_factor > 0:
            raise QkvError(f"model.rope_high_freq_factor={self.high_freq_factor} must exceed "
                           f"model.rope_low_freq_factor={self.low_freq_factor} > 0")
        if self.kind == "yarn" and not self.beta_fast > self.beta_slow > 0:
            raise QkvError(f"model.rope_beta_fast={self.beta_fast} must exceed model.rope_beta_slow={self.beta_slow} > 0")
        return self


NO_SCALING = RopeScaling()


def base_frequencies(head_dim: int, base: float) -> np.ndarray:
    """theta_i = base^(-2i/Dh), i < Dh/2 (note 003), float64."""
    return base ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)


def frequencies(head_dim: int, base: float, scaling: RopeScaling = NO_SCALING, rotated: int = 0,
                length: int = 0) -> tuple[np.ndarray, float]:
    """(theta (Dh/2,) float64, m): pair i turns by pos * theta_i, and cos and sin are multiplied by m.
    `rotated` < Dh (partial rotation): the first rotated / 2 pairs turn at base^(-2i/rotated), the others by 0,
    unturned (model.rope_dims). `length`: the positions a forward reaches (longrope's choice of set)."""
    rotated = rotated or head_dim
    theta, m = scaled(base_frequencies(rotated, base), rotated, base, scaling, length)
    return np.concatenate([theta, np.zeros((head_dim - rotated) // 2)]), m


def scaled(theta: np.ndarray, dim: int, base: float, scaling: RopeScaling,
           length: int = 0) -> tuple[np.ndarray, float]:
    s = scaling.factor
    if scaling.kind == "longrope":
        divisors = scaling.long_factors if length > scaling.original_context else scaling.short_factors
        if len(divisors) != theta.size:
            raise QkvError(f"model.rope_long_factors / rope_short_factors have {len(divisors)} entries for "
                           f"{theta.size} turned pairs")
        return theta / np.asarray(divisors, dtype=np.float64), scaling.attention_factor
    if scaling.kind == "none":
        return theta, 1.0
    if scaling.kind == "linear":
        return theta / s, 1.0
    if scaling.kind == "llama3":
        return llama3(theta, scaling), 1.0
    return yarn(theta, dim, base, scaling)


def llama3(theta: np.ndarray, scaling: RopeScaling) -> np.ndarray:
    """Llama 3.1's piecewise stretch of the wavelengths lambda_i = 2 pi / theta_i (module docstring)."""
    s, L = scaling.factor, scaling.original_context
    low, high = scaling.low_freq_factor, scaling.high_freq_factor
    wavelength = 2 * math.pi / theta
    a = (L / wavelength - low) / (high - low)  # 0 at lambda = L / low, 1 at lambda = L / high
    blended = (1 - a) * theta / s + a * theta
    return np.where(wavelength < L / high, theta, np.where(wavelength > L / low, theta / s, blended))


def yarn(theta: np.ndarray, head_dim: int, base: float, scaling: RopeScaling) -> tuple[np.ndarray, float]:
    """YaRN's "NTK-by-parts": pair i makes L theta_i / 2 pi turns in the original context; the pair index d(r)
    at which that count is r is d(r) = Dh ln(L / (2 pi r)) / (2 ln base). Pairs below d(beta_fast) (fast) are
    kept, pairs above d(beta_slow) are divided by s, and a linear ramp blends between (its ends rounded out,
    as the paper's code does); m = 0.1 ln s + 1 restores the softmax's temperature."""
    s, L = scaling.factor, scaling.original_context

    def pair_at(turns: float) -> float:
        return head_dim * math.log(L / (turns * 2 * math.pi)) / (2 * math.log(base))

    low, high = pair_at(scaling.beta_fast), pair_at(scaling.beta_slow)
    if scaling.yarn_truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    high = high if high != low else high + 0.001  # a ramp of width 0 would divide by 0
    ramp = np.clip((np.arange(head_dim // 2, dtype=np.float64) - low) / (high - low), 0, 1)
    kept = 1 - ramp  # 1: the pair keeps theta_i, 0: theta_i / s
    m = scaling.yarn_mscale or (0.1 * math.log(s) + 1.0 if s > 1 else 1.0)
    return theta / s * (1 - kept) + theta * kept, m
