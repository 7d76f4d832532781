"""Relative positional encodings (note 000 §15.3; T5 beyond the notes), through the score_bias and
value_bias hooks of qkv.nn.positional. Relative positions come from the (B, T) / (B, S) positions of
queries and keys, so left padding and KV caches (cached keys keep their positions) need nothing special.

One module serves every layer (as T5's bias and Transformer-XL's u, v are shared); Shaw et al. and
Transformer-XL's W_R are per layer in the papers (docs/DEVIATIONS.md).
"""
from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from qkv.nn.kernels import RelativeValues
from qkv.nn.positional import POSITIONALS, Positional, sinusoidal_table

INDEX = 8  # bytes of a long index element
T5_BUCKETS = 32  # T5's default relative_attention_num_buckets (model.t5_buckets); the bucket range is
# model.max_distance (T5: 128)


def gather_relative(per_offset: Tensor, index: Tensor) -> Tensor:
    """score[b, h, i, j] = per_offset[b, h, i, index[b, i, j]]: (B, H, T, R) and (B, T, S) -> (B, H, T, S)."""
    B, H, T, _ = per_offset.shape
    return per_offset.gather(-1, index[:, None].expand(B, H, T, index.shape[-1]))


@POSITIONALS.register("shaw")
class ShawRelative(Positional):
    """Shaw et al. 2018 (note 000 §15.3.1): with a^K_ij = w^K_{clip(j - i, -k, k)} and a^V_ij likewise,

        e_ij = q_i . (k_j + a^K_ij) / sqrt(Dh),   z_i = sum_j softmax(e)_ij (v_j + a^V_ij),

    k = model.max_distance; the tables (2k + 1, Dh) are shared by the heads (as in the paper). The note
    writes r_{i-j}; the paper indexes j - i: the same table read backwards.
    """

    score_bias_kind = "content"
    value_term = True

    @staticmethod
    def hook_saves(B, H, T, S, *, a, head_dim, max_distance, value_buckets):
        """The matmul's copy of q (B H T, Dh), the gather's (B, T, S) index and its input q . w^K (B, H, T,
        2k+1); the value term's index and, where the kernel forms A, its fp32 buckets (B, H, T, 2k+1)."""
        rows = 2 * max_distance + 1
        value = INDEX * B * T * S + (4 * B * H * T * rows if value_buckets else 0)
        return a * B * H * T * head_dim + INDEX * B * T * S + a * B * H * T * rows + value

    @staticmethod
    def hook_backward(B, H, T, S, *, a, max_distance):
        """The scaled bias gradient and the gather's scattered (B, H, T, 2k+1) gradient."""
        return a * B * H * T * S + a * B * H * T * (2 * max_distance + 1)

    def __init__(self, *, head_dim: int, max_distance: int, **dims):
        super().__init__()
        self.max_distance = max_distance
        self.scale = head_dim ** -0.5
        self.key_table = nn.Embedding(2 * max_distance + 1, head_dim)  # w^K (2k+1, Dh)
        self.value_table = nn.Embedding(2 * max_distance + 1, head_dim)  # w^V (2k+1, Dh)

    def relative_index(self, q_positions: Tensor, k_positions: Tensor) -> Tensor:
        """clip(j - i, -k, k) + k: the table row of every (query, key) pair. (B, T, S)"""
        offset = k_positions[:, None, :] - q_positions[:, :, None]
        return offset.clamp(-self.max_distance, self.max_distance) + self.max_distance

    def score_bias(self, q_positions, k_positions, q=None, k=None) -> Tensor:
        per_offset = q @ self.key_table.weight.to(q.dtype).T  # q_i . w^K_r   (B, H, T, 2k+1)
        return gather_relative(per_offset, self.relative_index(q_positions, k_positions)) * self.scale

    def value_bias(self, q_positions, k_positions) -> RelativeValues:
        return RelativeValues(self.relative_index(q_positions, k_positions), self.value_table.weight)


@POSITIONALS.register("xl")
class TransformerXL(Positional):
    """Transformer-XL (Dai et al. 2019, eq. 3; note 000 §15.3.2): the four terms

        A_ij = q_i.k_j + q_i.W_R R_{i-j} + u.k_j + v.W_R R_{i-j} = (q_i + u).k_j + (q_i + v).W_R R_{i-j}

    (times 1/sqrt(Dh)), R the sinusoidal table of the distance i - j (note 000 §3.1), W_R (H*Dh, D), u and
    v (H, Dh) learnt. The kernel computes q_i.k_j; this hook returns the other three. The note's form
    "q_i R_{i-j}^T u^T + v^T R_{i-j} k_j^T" mixes the terms up (docs/DEVIATIONS.md).

    Segment-level recurrence: run segment s + 1 with the KVCache that segment s filled (its keys and values
    are the memory; positions continue, and the distances i - j above reach into it), after
    `cache.detach()` (the paper's stop-gradient SG(h^{n-1}_{tau})); `cache.keep_last(M)` keeps a memory
    of M columns. The cached keys are W_K h of the previous segment's states, as in the paper, but held
    fixed rather than recomputed with the current W_K: no gradient reaches W_K through the memory.
    """

    score_bias_kind = "content"

    @staticmethod
    def hook_saves(B, H, T, S, *, a, head_dim, max_distance, value_buckets):
        """For the matmuls: q + v (B, H, T, Dh), W_R R_d over the T + S - 1 distances and its copy per
        sequence, k's copy for u . k_j; the gather's (B, T, S) index and its input (B, H, T, T + S - 1)."""
        R = T + S - 1
        matmuls = a * B * H * (T + S) * head_dim + a * (B + 1) * H * head_dim * R
        return matmuls + INDEX * B * T * S + a * B * H * T * R

    @staticmethod
    def hook_backward(B, H, T, S, *, a, max_distance):
        """The scaled bias gradient and the gather's scattered (B, H, T, T + S - 1) gradient."""
        return a * B * H * T * S + a * B * H * T * (T + S - 1)

    def __init__(self, *, d_model: int, n_heads: int, head_dim: int, **dims):
        super().__init__()
        self.d_model, self.n_heads, self.head_dim = d_model, n_heads, head_dim
        self.scale = head_dim ** -0.5
        self.r_proj = nn.Linear(d_model, n_heads * head_dim, bias=False)  # W_{k,R} (H*Dh, D)
        self.content_bias = nn.Parameter(torch.zeros(n_heads, head_dim))  # u (H, Dh)
        self.position_bias = nn.Parameter(torch.zeros(n_heads, head_dim))  # v (H, Dh)

    def score_bias(self, q_positions, k_positions, q=None, k=None) -> Tensor:
        distance = q_positions[:, :, None] - k_positions[:, None, :]  # i - j   (B, T, S)
        low, high = int(distance.min()), int(distance.max())
        wide = torch.promote_types(q.dtype, torch.float32)  # the table's angles in fp32 (or fp64)
        table = sinusoidal_table(torch.arange(low, high + 1, device=q.device), self.d_model, dtype=wide)  # (R, D)
        r = self.r_proj(table.to(self.r_proj.weight.dtype)).to(q.dtype)  # W_R R_d   (R, H*Dh)
        r = r.view(-1, self.n_heads, self.head_dim).permute(1, 2, 0)  # (H, Dh, R)
        position = (q + self.position_bias[:, None].to(q.dtype)) @ r  # (q_i + v) . W_R R_d   (B, H, T, R)
        content = k @ self.content_bias[..., None].to(k.dtype)  # u . k_j   (B, H, S, 1)
        return (gather_relative(position, distance - low) + content.transpose(-2, -1)) * self.scale


def t5_bucket(relative_position: Tensor, *, bidirectional: bool, num_buckets: int, max_distance: int) -> Tensor:
    """T5's bucketing of j - i (Raffel et al. 2020; HF's _relative_position_bucket): bidirectional halves
    the buckets by sign; causal maps j > i to 0. Distances below max_exact = buckets/2 get one bucket each,
    larger ones log-spaced buckets up to max_distance, beyond it the last bucket."""
    buckets = torch.zeros_like(relative_position)
    if bidirectional:
        num_buckets //= 2
        buckets = buckets + (relative_position > 0).long() * num_buckets
        distance = relative_position.abs()
    else:
        distance = (-relative_position).clamp(min=0)
    max_exact = num_buckets // 2
    span = math.log(max_distance / max_exact) if max_distance > max_exact else 0.0
    if span > 0:
        log_ratio = torch.log(distance.clamp(min=max_exact).float() / max_exact) / span
        large = max_exact + (log_ratio * (num_buckets - max_exact)).long()
        large = large.clamp(max=num_buckets - 1)
    else:  # max_distance within the exact range: every larger distance shares the last bucket
        large = torch.full_like(distance, num_buckets - 1)
    return buckets + torch.where(distance < max_exact, distance, large)


@POSITIONALS.register("t5")
class T5Bias(Positional):
    """T5's learnt bucketed bias (beyond the notes): score_ij += b_h[bucket(j - i)], one scalar per head and
    bucket, shared by all layers. "t5" buckets both directions (encoders); "t5_causal" spends every bucket
    on the past (T5's decoder)."""

    bidirectional = True
    decoder_twin = "t5_causal"
    score_bias_kind = "learned"

    @staticmethod
    def hook_saves(B, H, T, S, *, a, head_dim, max_distance, value_buckets):
        """The embedding's (B, T, S) bucket index."""
        return INDEX * B * T * S

    @staticmethod
    def hook_backward(B, H, T, S, *, a, max_distance):
        """The bias gradient laid out (B, T, S, H) for the embedding's backward (fp32, as the bias)."""
        return 4 * B * H * T * S

    def __init__(self, *, n_heads: int, max_distance: int, t5_buckets: int = T5_BUCKETS, **dims):
        super().__init__()
        self.max_distance, self.num_buckets = max_distance, t5_buckets
        self.relative_attention_bias = nn.Embedding(t5_buckets, n_heads)  # (buckets, H)

    def buckets(self, q_positions: Tensor, k_positions: Tensor) -> Tensor:  # (B, T, S)
        return t5_bucket(k_positions[:, None, :] - q_positions[:, :, None], bidirectional=self.bidirectional,
                         num_buckets=self.num_buckets, max_distance=self.max_distance)

    def score_bias(self, q_positions, k_positions, q=None, k=None) -> Tensor:
        bias = self.relative_attention_bias(self.buckets(q_positions, k_positions))  # (B, T, S, H)
        return bias.permute(0, 3, 1, 2)  # (B, H, T, S)


@POSITIONALS.register("t5_causal")
class T5CausalBias(T5Bias):
    bidirectional = False
    decoder_twin = None
