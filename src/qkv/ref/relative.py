"""Relative positional encodings with learnt parameters, forward and hand-written backward (as
qkv.nn.relative; docs/derivations/relative_positions.md). Each acts through the score-bias hooks of
qkv.ref.positional; the kernel returns dS = dL/d(bias) and the hooks turn it into dq, dk and table gradients.

    Shaw (note 000 §15.3.1):  b_ij = q_i . w^K[idx_ij] / sqrt(Dh),  out_i += sum_j A_ij w^V[idx_ij],
                              idx_ij = clip(j - i, -k, k) + k
    Transformer-XL (§15.3.2): b_ij = ((q_i + v) . (W_R R_{i-j}) + u . k_j) / sqrt(Dh)
    T5:                       b_hij = W[bucket(j - i), h]

All three read a per-offset table and gather it per (i, j); every backward is the adjoint of that gather,
a scatter-add over the pairs that share a table row (as the embedding's, 000 LLM §3.5).
"""
from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

from qkv.ref.kernels import RelativeValues
from qkv.ref.positional import POSITIONALS, Positional, sinusoidal_table



def gather_relative(per_offset: np.ndarray, index: np.ndarray) -> np.ndarray:
    """out[b, h, i, j] = per_offset[b, h, i, index[b, i, j]]: (B, H, T, R), (B, T, S) -> (B, H, T, S)."""
    B, H, T, _ = per_offset.shape
    return np.take_along_axis(per_offset, np.broadcast_to(index[:, None], (B, H, T, index.shape[-1])), axis=-1)


def scatter_relative(dout: np.ndarray, index: np.ndarray, rows: int) -> np.ndarray:
    """The adjoint of gather_relative: d per_offset[b, h, i, r] = sum_{j: index[b, i, j] = r} dout[b, h, i, j].
    (B, H, T, S) -> (B, H, T, R)"""
    onehot = (index[..., None] == np.arange(rows)).astype(dout.dtype)  # (B, T, S, R)
    return np.einsum("bhts,btsr->bhtr", dout, onehot)


@POSITIONALS.register("shaw")
class ShawRelative(Positional):
    """per_offset = q w^K^T (B, H, T, 2k+1), b = gather(per_offset, idx) / sqrt(Dh). Backward:
    dper_offset = scatter(db) / sqrt(Dh); dq = dper_offset w^K; dw^K = sum_{b,h,t} dper_offset^T q.
    The value term's gradients come from the kernel (qkv.ref.kernels.RelativeValues.backward)."""

    value_param = "value_table.weight"

    def relative_index(self, q_positions, k_positions):
        offset = k_positions[:, None, :] - q_positions[:, :, None]  # j - i   (B, T, S)
        k = self.cfg.max_distance
        return np.clip(offset, -k, k) + k

    def score_bias_forward(self, params, q, k, q_positions, k_positions):
        table = params["key_table.weight"]  # w^K (2k+1, Dh)
        index = self.relative_index(q_positions, k_positions)
        scale = q.shape[-1] ** -0.5
        return gather_relative(q @ table.T, index) * scale, (q, table, index, scale)

    def score_bias_backward(self, dbias, cache, grads):
        q, table, index, scale = cache
        dper_offset = scatter_relative(dbias, index, table.shape[0]) * scale  # (B, H, T, 2k+1)
        grads.add("key_table.weight", np.einsum("bhtr,bhtd->rd", dper_offset, q))
        return dper_offset @ table, None

    def value_bias(self, params, q_positions, k_positions):
        return RelativeValues(self.relative_index(q_positions, k_positions), params["value_table.weight"])


class XLCache(NamedTuple):
    k: np.ndarray
    shifted: np.ndarray  # q + v (the position bias)   (B, H, T, Dh)
    r: np.ndarray  # W_R R of the distances present   (H, Dh, R)
    table: np.ndarray  # R, the sinusoidal rows   (R, D)
    index: np.ndarray  # (i - j) - low   (B, T, S)
    u: np.ndarray  # the content bias   (H, Dh)
    scale: float


@POSITIONALS.register("xl")
class TransformerXL(Positional):
    """position_ir = (q_i + v) . r_r with r = W_R R (R the sinusoidal table of the distances i - j present),
    content_j = u . k_j; b_ij = (position[i, (i - j) - low] + content_j) / sqrt(Dh). Backward, with
    dP = scatter(db) / sqrt(Dh) (B, H, T, R) and dc = sum_i db / sqrt(Dh) (B, H, S):
        dq = dP r^T;  dv = sum_{b,t} dP r^T;  dr = sum_{b,t} (q + v)^T dP;  dW_R = dr_flat^T R_table
        dk = dc u;    du = sum_{b,s} dc k"""

    def score_bias_forward(self, params, q, k, q_positions, k_positions):
        H, Dh = params["content_bias"].shape
        distance = q_positions[:, :, None] - k_positions[:, None, :]  # i - j   (B, T, S)
        low, high = int(distance.min()), int(distance.max())
        table = sinusoidal_table(np.arange(low, high + 1), self.cfg.d_model)  # R_d   (R, D)
        r = (table @ params["r_proj.weight"].T).reshape(-1, H, Dh).transpose(1, 2, 0)  # W_R R_d   (H, Dh, R)
        shifted = q + params["position_bias"][:, None]  # q_i + v   (B, H, T, Dh)
        content = k @ params["content_bias"][..., None]  # u . k_j   (B, H, S, 1)
        scale = Dh ** -0.5
        bias = (gather_relative(shifted @ r, distance - low) + np.swapaxes(content, -1, -2)) * scale
        return bias, XLCache(k, shifted, r, table, distance - low, params["content_bias"], scale)

    def score_bias_backward(self, dbias, cache, grads):
        k, shifted, r, table, index, u, scale = cache
        dposition = scatter_relative(dbias, index, r.shape[-1]) * scale  # (B, H, T, R)
        dshifted = dposition @ np.swapaxes(r, -1, -2)  # (B, H, T, Dh): dq, and dv summed
        dr = np.einsum("bhtd,bhtr->hdr", shifted, dposition)  # (H, Dh, R)
        dr_flat = dr.transpose(2, 0, 1).reshape(r.shape[-1], -1)  # (R, H*Dh)
        dcontent = dbias.sum(axis=-2) * scale  # (B, H, S)
        dk = dcontent[..., None] * u[None, :, None, :]  # (B, H, S, Dh)
        grads.add("r_proj.weight", dr_flat.T @ table)
        grads.add("position_bias", dshifted.sum(axis=(0, 2)))
        grads.add("content_bias", np.einsum("bhs,bhsd->hd", dcontent, k))
        return dshifted, dk


def t5_bucket(relative_position: np.ndarray, *, bidirectional: bool, num_buckets: int, max_distance: int):
    """qkv.nn.relative.t5_bucket in NumPy (Raffel et al. 2020), the log in float32 as torch's `.float()`."""
    buckets = np.zeros_like(relative_position)
    if bidirectional:
        num_buckets //= 2
        buckets = buckets + (relative_position > 0) * num_buckets
        distance = np.abs(relative_position)
    else:
        distance = np.maximum(-relative_position, 0)
    max_exact = num_buckets // 2
    span = math.log(max_distance / max_exact) if max_distance > max_exact else 0.0
    if span > 0:
        ratio = np.log(np.maximum(distance, max_exact).astype(np.float32) / np.float32(max_exact)) / np.float32(span)
        large = np.minimum(max_exact + (ratio * (num_buckets - max_exact)).astype(np.int64), num_buckets - 1)
    else:
        large = np.full_like(distance, num_buckets - 1)
    return buckets + np.where(distance < max_exact, distance, large)


@POSITIONALS.register("t5")
class T5Bias(Positional):
    """b_hij = W[bucket(j - i), h]; dW[r, h] = sum_{b, i, j: bucket = r} db_hij (a scatter-add)."""

    bidirectional = True
    decoder_twin = "t5_causal"  # T5's decoder spends its buckets on the past

    def score_bias_forward(self, params, q, k, q_positions, k_positions):
        table = params["relative_attention_bias.weight"]  # (buckets, H)
        buckets = t5_bucket(k_positions[:, None, :] - q_positions[:, :, None], bidirectional=self.bidirectional,
                            num_buckets=table.shape[0], max_distance=self.cfg.max_distance)  # (B, T, S)
        return table[buckets].transpose(0, 3, 1, 2), (buckets, table.shape)  # (B, H, T, S)

    def score_bias_backward(self, dbias, cache, grads):
        buckets, shape = cache
        dtable = np.zeros(shape, dtype=dbias.dtype)
        np.add.at(dtable, buckets.reshape(-1), dbias.transpose(0, 2, 3, 1).reshape(-1, shape[1]))
        grads.add("relative_attention_bias.weight", dtable)
        return None, None


@POSITIONALS.register("t5_causal")
class T5CausalBias(T5Bias):
    decoder_twin = None
    bidirectional = False
