"""Positional encodings, acting through hooks with identity defaults.

- `embed(x, positions)`: added to the token embeddings (absolute encodings);
- `rotate(q, k, positions)`: applied to queries and keys in every layer (RoPE);
- `score_bias(q_positions, k_positions, q=None, k=None)`: added to the scaled attention scores (ALiBi, T5).
  Content-dependent biases (Shaw's q_i . a^K_ij, Transformer-XL's u . k_j + (q_i + v) . W_R R_{i-j}) read
  q (B, H, T, Dh) and k (B, H, S, Dh), both after `rotate` and the K/V head repeat, and return their term
  already multiplied by 1/sqrt(Dh), since kernels add the bias to Q K^T * scale;
- `value_bias(q_positions, k_positions)`: a `RelativeValues` term the kernel adds to the weighted values
  (Shaw's sum_j a_ij a^V_ij), or None.

Each class states its properties beside its hooks: `shift_invariant` (positions are seen only through
differences, so a rolling cache may generate past max_seq_len: qkv.generate.families), `decoder_twin` (the
registry name of its form in an encoder-decoder's decoder, or None for the same) and `even_head_dim`
(rotates pairs of head coordinates), `score_bias_kind` (what its dense (B, H, T, S) score bias is made
from: None, "fixed" (no parameters), "learned" (a table) or "content" (q and k); a kernel that keeps no
probabilities saves it for its backward), `value_term` (has a value_bias), `hook_saves` and
`hook_backward` (the bytes its hooks keep for the backward per layer, and form in it): the last four are
qkv calc's.

Every encoding takes the same keyword arguments (d_model, n_heads, head_dim, max_seq_len,
rope_theta, max_distance) and ignores the ones it does not use. Positions are (B, T) integer
tensors, so left-padded rows can carry their own positions.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from qkv.errors import QkvError
from qkv.nn.kernels import RelativeValues
from qkv.rope_scaling import NO_SCALING, RopeScaling, frequencies
from qkv.registry import Registry

POSITIONALS: Registry[type["Positional"]] = Registry("positional encoding")


class Positional(nn.Module):
    """No positional information: every hook is the identity."""

    shift_invariant = True  # positions only through differences (here: not at all)
    decoder_twin: str | None = None  # the encoder-decoder's decoder uses this registry entry instead
    even_head_dim = False  # needs an even head width
    score_bias_kind: str | None = None  # "fixed", "learned", "content": what its (B, H, T, S) bias is made from
    value_term = False  # adds a RelativeValues term to the weighted values

    def __init__(self, **dims):
        super().__init__()

    def embed(self, x: Tensor, positions: Tensor) -> Tensor:
        return x

    def rotate(self, q: Tensor, k: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
        return q, k

    def score_bias(self, q_positions: Tensor, k_positions: Tensor, q: Tensor | None = None,
                   k: Tensor | None = None) -> Tensor | None:
        return None

    def value_bias(self, q_positions: Tensor, k_positions: Tensor) -> RelativeValues | None:
        return None

    @staticmethod
    def hook_saves(B: int, H: int, T: int, S: int, *, a: int, head_dim: int, max_distance: int,
                   value_buckets: bool) -> int:
        """Bytes its score and value hooks keep for the backward in one layer, beyond the dense bias the
        kernel may keep (measured with saved_tensors_hooks: tests/analysis/test_memory.py); `a`: bytes of
        q's elements, `value_buckets`: the kernel keeps a value term's per-row buckets (all but flash)."""
        return 0

    @staticmethod
    def hook_backward(B: int, H: int, T: int, S: int, *, a: int, max_distance: int) -> int:
        """Bytes its hooks' backward forms at once from the bias gradient (B, H, T, S) (qkv calc's peak)."""
        return 0


POSITIONALS.register("none")(Positional)


def sinusoid_angles(positions: Tensor, dim: int, base: float, dtype=torch.float32) -> Tensor:
    """angle[pos, i] = pos / base^(2i/dim) for i < dim/2, in fp32 or wider (positions up to ~1e5 need it)."""
    inv_freq = base ** (-torch.arange(0, dim, 2, device=positions.device, dtype=dtype) / dim)
    return positions.to(dtype)[..., None] * inv_freq  # (..., dim/2)


def sinusoidal_table(positions: Tensor, dim: int, base: float = 10000.0, dtype=torch.float32) -> Tensor:
    """PE(pos, 2i) = sin(pos / 10000^(2i/d)), PE(pos, 2i+1) = cos(pos / 10000^(2i/d)) (note 000 §3.1)."""
    angles = sinusoid_angles(positions, dim, base, dtype)
    return torch.stack((angles.sin(), angles.cos()), dim=-1).flatten(-2)[..., :dim]  # (..., dim)


@POSITIONALS.register("sinusoidal")
class Sinusoidal(Positional):
    shift_invariant = False  # absolute: positions past max_seq_len were never trained on

    def __init__(self, *, d_model: int, **dims):
        super().__init__()
        self.d_model = d_model

    def embed(self, x: Tensor, positions: Tensor) -> Tensor:  # (B, T, D)
        dtype = torch.promote_types(x.dtype, torch.float32)  # fp32 angles, fp64 for fp64 models
        return x + sinusoidal_table(positions, self.d_model, dtype=dtype).to(x.dtype)


@POSITIONALS.register("learned")
class Learned(Positional):
    """A trained table P (max_seq_len, D); H0 = E + P[positions] (note 000 LLM §2.1)."""

    shift_invariant = False  # absolute: the table has no row max_seq_len

    def __init__(self, *, d_model: int, max_seq_len: int, **dims):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(max_seq_len, d_model))  # (max_seq_len, D)

    def embed(self, x: Tensor, positions: Tensor) -> Tensor:
        # (a compiled decoding step checks its position before the step: qkv.generate.compiled)
        if not torch.compiler.is_compiling() and positions.numel() and int(positions.max()) >= self.weight.shape[0]:
            raise QkvError(
                f"position {int(positions.max())} is beyond the learned table's {self.weight.shape[0]} positions"
            )
        return x + self.weight[positions]


@POSITIONALS.register("rope")
class Rotary(Positional):
    """RoPE (note 003): rotate each pair of q and k by pos * theta_i, so q_m . k_n depends on n - m only.

    Pairs are (i, i + Dh/2) (the "rotate half" layout of GPT-NeoX and LLaMA in Hugging Face) rather
    than the note's (2i, 2i+1); the two differ by a fixed permutation of the head dimensions, which
    leaves every dot product unchanged (docs/DEVIATIONS.md). `rope_scaling` stretches the frequencies for a
    long context (qkv.rope_scaling: linear, llama3, yarn).
    """

    even_head_dim = True  # rotates pairs of head coordinates

    def __init__(self, *, head_dim: int, rope_theta: float, rope_scaling: RopeScaling = NO_SCALING,
                 rope_dims: int = 0, **dims):
        super().__init__()
        self.head_dim = head_dim
        self.theta, self.scaling = rope_theta, rope_scaling
        # theta_i (Dh/2,) in float64 on the CPU and m: a plain attribute, not a buffer (a loader's meta-device
        # model has none to fill), moved to the positions' device and dtype when used
        theta, self.attention_factor = frequencies(head_dim, rope_theta, rope_scaling, rope_dims)  # 0 past rope_dims
        self.frequencies = torch.tensor(theta, dtype=torch.float64, device="cpu")
        self.long_from, self.long_frequencies = 0, None  # longrope: its long set, for positions past the original
        if rope_scaling.kind == "longrope":
            self.long_from = rope_scaling.original_context
            far, _ = frequencies(head_dim, rope_theta, rope_scaling, rope_dims, length=rope_scaling.original_context + 1)
            self.long_frequencies = torch.tensor(far, dtype=torch.float64, device="cpu")
        self._last: tuple | None = None  # (positions, its version, dtype, cos, sin) of the last call

    def rotate(self, q: Tensor, k: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
        cos, sin = self.cos_sin(positions, torch.promote_types(q.dtype, torch.float32))
        return rotate_half(q, cos, sin), rotate_half(k, cos, sin)

    def cos_sin(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """cos and sin of pos * theta_i (times m), (B, 1, T, Dh) each, in fp32 at least: at position 1e4, bf16
        angles would be off by whole radians (fp64 models keep fp64). Every layer of one forward rotates by the
        same positions tensor: they are computed once and reused while that tensor is unchanged (a decoding
        step of a 30-layer model: 180 small ops fewer)."""
        last = self._last
        version = -1 if positions.is_inference() else positions._version  # inference tensors keep no version
        if (last is not None and last[0] is positions and last[1] == version and last[2] == dtype
                and not torch.is_grad_enabled()):
            return last[3], last[4]
        theta = self.frequencies  # longrope: the long set where this forward reaches past the original context
        if self.long_frequencies is not None and positions.numel() and int(positions.max()) + 1 > self.long_from:
            theta = self.long_frequencies
        cos, sin = rotary_cos_sin(positions, theta, self.attention_factor, dtype)
        self._last = None if torch.is_grad_enabled() else (positions, version, dtype, cos, sin)
        return cos, sin


def rotary_cos_sin(positions: Tensor, theta: Tensor, factor: float, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """factor cos and factor sin of pos * theta_i for (B, T) positions and (Dh/2,) frequencies, each
    (B, 1, T, Dh) in `dtype` (the rotate-half layout)."""
    angles = positions.to(dtype)[..., None] * theta.to(positions.device, dtype)  # (B, T, Dh/2)
    cos, sin = angles.cos().repeat(1, 1, 2)[:, None], angles.sin().repeat(1, 1, 2)[:, None]
    return (cos, sin) if factor == 1.0 else (cos * factor, sin * factor)


def rotate_half(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x * cos + R(x) * sin, R(x1, x2) = (-x2, x1): the 2x2 rotation of note 003 on each pair."""
    wide = x.to(cos.dtype)  # (B, H, T, Dh) in the angles' precision, at least fp32
    x1, x2 = wide.chunk(2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)
    return (wide * cos + rotated * sin).to(x.dtype)


def alibi_slopes(n_heads: int) -> Tensor:
    """Head slopes 2^(-8h/H) (Press et al. 2022), with their rule for H not a power of two."""
    closest = 2 ** math.floor(math.log2(n_heads))
    slopes = [2 ** (-8 * (h + 1) / closest) for h in range(closest)]
    extra = [2 ** (-4 * (2 * h + 1) / closest) for h in range(n_heads - closest)]
    return torch.tensor(slopes + extra)


@POSITIONALS.register("alibi")
class ALiBi(Positional):
    """Attention with linear biases (beyond the notes): score_ij -= m_h * |i - j|."""

    score_bias_kind = "fixed"

    def __init__(self, *, n_heads: int, **dims):
        super().__init__()
        self.register_buffer("slopes", alibi_slopes(n_heads), persistent=False)  # (H,)

    def score_bias(self, q_positions: Tensor, k_positions: Tensor, q: Tensor | None = None,
                   k: Tensor | None = None) -> Tensor:
        distance = (q_positions[:, :, None] - k_positions[:, None, :]).abs().float()  # (B, T, S)
        return -self.slopes[None, :, None, None] * distance[:, None]  # (B, H, T, S)

