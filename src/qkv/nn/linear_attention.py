"""Linear attention (note 000 §15.2; Katharopoulos et al. 2020):

    O_i = phi(q_i)^T sum_j phi(k_j) v_j^T / (phi(q_i)^T sum_j phi(k_j)),   phi(x) = elu(x) + 1 > 0

the note's kernel approximation exp(q.k) ~ phi(q).phi(k) with Katharopoulos' feature map (the note leaves
phi open). Non-causal: the sums KV = phi(K)^T V (Dh, Dh) and z = phi(K)^T 1 once, O(n Dh^2). Causal: the
same sums as prefix sums, carried across chunks of CHUNK queries (inside a chunk the explicit lower
triangle), O(n Dh^2 + n CHUNK Dh) time and O(n Dh + Dh^2) memory. Queries are the last T of S columns.
The feature map replaces exp(q.k / sqrt(d_k)), so `scale` does not apply (as in qkv.ref).

A padding mask, a score bias or a value term has no O(n) form: then the kernel computes its explicit
form sim_ij = phi(q_i).phi(k_j) exp(bias_ij) [allowed], A = sim / rowsum(sim) (the softmax identity
exp(s + b) = exp(s) exp(b), with phi.phi in place of exp(s)), in O(n^2). Attention dropout does not
apply (the weights are never formed); the output projection's dropout does.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from qkv.nn.kernels import KERNELS, KernelSpec, RelativeValues, weighted_values, wide_dtype
from qkv.nn.masks import causal_mask

CHUNK = 64  # queries per step of the causal prefix sums


def feature_map(x: Tensor) -> Tensor:
    """phi(x) = elu(x) + 1, in at least fp32 (the normaliser sums n positive terms)."""
    return F.elu(x.to(wide_dtype(x.dtype))) + 1


def linear_weights(q: Tensor, k: Tensor, *, mask: Tensor | None, causal: bool, bias: Tensor | None,
                   scale: float = 1.0, on_scores=None) -> Tensor:
    """The explicit O(n^2) form: A_ij = sim_ij / sum_j sim_ij, sim_ij = phi(q_i).phi(k_j) exp(b_ij) [allowed].

    `on_scores` sees sim (0 where masked; the `attn.scores` point of a linear-attention model) and may replace it."""
    T, S = q.shape[-2], k.shape[-2]
    sim = feature_map(q) @ feature_map(k).transpose(-2, -1)  # (B, H, T, S)
    if bias is not None:
        sim = sim * torch.exp(bias)
    if mask is None and causal:
        mask = causal_mask(T, S, q.device)
    if mask is not None:
        sim = sim.masked_fill(~mask, 0.0)
    if on_scores is not None:
        sim = on_scores(sim)
    return sim / sim.sum(-1, keepdim=True)


def linear(q: Tensor, k: Tensor, v: Tensor, *, mask: Tensor | None, causal: bool, bias: Tensor | None,
           scale: float, dropout: float = 0.0, value_bias: RelativeValues | None = None) -> Tensor:
    if mask is not None or bias is not None or value_bias is not None:
        weights = linear_weights(q, k, mask=mask, causal=causal, bias=bias)
        return weighted_values(weights, v, value_bias, 0.0)
    qf, kf, vw = feature_map(q), feature_map(k), v.to(wide_dtype(v.dtype))
    if causal:
        return causal_linear(qf, kf, vw).to(v.dtype)
    kv = kf.transpose(-2, -1) @ vw  # sum_j phi(k_j) v_j^T   (B, H, Dh, Dh)
    z = kf.sum(-2)  # sum_j phi(k_j)   (B, H, Dh)
    return ((qf @ kv) / (qf @ z[..., None])).to(v.dtype)  # (B, H, T, Dh)


def causal_linear(qf: Tensor, kf: Tensor, v: Tensor) -> Tensor:
    """O_i = phi(q_i)^T KV_i / phi(q_i)^T z_i with KV_i, z_i the sums over keys j <= i (prefix sums)."""
    T, S = qf.shape[-2], kf.shape[-2]
    before = S - T  # cached keys: every query sees all of them
    kv = kf[:, :, :before].transpose(-2, -1) @ v[:, :, :before]  # (B, H, Dh, Dh)
    z = kf[:, :, :before].sum(-2)  # (B, H, Dh)
    outs = []
    for start in range(0, T, CHUNK):
        rows, cols = slice(start, min(start + CHUNK, T)), slice(before + start, before + min(start + CHUNK, T))
        q_c, k_c, v_c = qf[:, :, rows], kf[:, :, cols], v[:, :, cols]
        inside = (q_c @ k_c.transpose(-2, -1)).tril()  # j <= i within the chunk   (B, H, c, c)
        numerator = q_c @ kv + inside @ v_c  # (B, H, c, Dh)
        denominator = q_c @ z[..., None] + inside.sum(-1, keepdim=True)  # (B, H, c, 1)
        outs.append(numerator / denominator)
        kv = kv + k_c.transpose(-2, -1) @ v_c
        z = z + k_c.sum(-2)
    return torch.cat(outs, dim=2)  # (B, H, T, Dh)


# no (T, S) probabilities: the O(n) path saves phi(q), phi(k) and the feature map's inputs (qkv calc counts
# those; it leaves out each chunk's (c, c) products, T x CHUNK per head: its estimate is 0.83 of a measured
# training step at T = 96, 0.72 at T = 512)
KERNELS.register("linear")(KernelSpec(fn=linear, weights=linear_weights, full=False, exact=False,
                                      keeps_probabilities=False, copied_rows=lambda T, S, w: 2 * (T + S)))
