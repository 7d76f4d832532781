"""One layer's self-attention inside the compiled decoding step (qkv.generate.compiled): the new columns' q, k, v,
their rotation, the cache written in place and the attention over it (note 003, 推理原理: 缓存 K/V, each new
token attending to every cached column it may see), written as functions TorchDynamo traces whole."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from qkv.nn.decoding_linear import stored, summed_rows
from qkv.nn.fastpath import fused_or_none
from qkv.nn.positional import rotate_half


def attend(attn: nn.Module, h: Tensor, rope: tuple[Tensor, Tensor] | None, k_all: Tensor, v_all: Tensor,
           n: int, mask: Tensor) -> Tensor:
    """One layer's self-attention for the new columns n - T .. n - 1: (B, T, D) -> (B, T, D)."""
    B, T = h.shape[:2]
    H, Hkv, Dh = attn.n_heads, attn.n_kv_heads, attn.head_dim
    fused = fused_or_none(attn, "fused_qkv", attn.q_proj, attn.k_proj, attn.v_proj)
    if fused is not None:
        q, k, v = fused(h).split((H * Dh, Hkv * Dh, Hkv * Dh), dim=-1)
    else:
        q, k, v = attn.q_proj(h), attn.k_proj(h), attn.v_proj(h)
    if T == 1:  # one column: no transpose
        q, k, v = q.view(B, H, 1, Dh), k.view(B, Hkv, 1, Dh), v.view(B, Hkv, 1, Dh)
    else:  # (B, heads, T, Dh)
        q, k, v = (t.view(B, T, t.shape[-1] // Dh, Dh).transpose(1, 2) for t in (q, k, v))
    if attn.q_norm is not None:
        q, k = attn.q_norm(q), attn.k_norm(k)
    if rope is not None:
        q, k = rotate_half(q, *rope), rotate_half(k, *rope)
    if T == 1:  # into the preallocated cache, in place
        k_all[:, :, n - 1:n] = k
        v_all[:, :, n - 1:n] = v
    else:  # (by index: a slice from n - T would guard on where it starts, n - T <= 0 when traced into an empty cache)
        own = torch.arange(n - T, n, device=k.device)
        k_all.index_copy_(2, own, k.to(k_all.dtype))  # (a cache in fp16 or bf16 under an fp32 model)
        v_all.index_copy_(2, own, v.to(v_all.dtype))
    if summed_rows(h):  # one row on a CPU where sums inductor writes are the faster (qkv.nn.decoding_linear)
        out = summed_attention(q, k_all[:, :, :n], v_all[:, :, :n], mask, Dh ** -0.5)
    else:
        k_seen, v_seen = k_all[:, :, :n].to(q.dtype), v_all[:, :, :n].to(q.dtype)
        out = F.scaled_dot_product_attention(q, k_seen, v_seen, attn_mask=mask, scale=Dh ** -0.5,
                                             enable_gqa=H != Hkv)  # (B, H, T, Dh)
    return attn.o_proj(out.reshape(B, 1, H * Dh) if T == 1 else out.transpose(1, 2).reshape(B, T, H * Dh))


def summed_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, scale: float) -> Tensor:
    """softmax(q K^T scale, masked) V for one query a row, as sums inductor generates: q (B, H, 1, Dh), k and v
    (B, Hkv, n, Dh) (query head h reads KV head h // (H / Hkv): GQA without copies), mask (B, 1, 1, n) True
    where a key may be seen; fp32 inside, the result in q's dtype. torch's CPU attention kernel takes 0.3 ms a
    layer for one bf16 query over 630 keys on the AMD EPYC (SmolLM2, 2 threads), a tenth of a step's time."""
    B, H, _, Dh = q.shape
    Hkv = k.shape[1]
    grouped = stored(q.reshape(B, Hkv, H // Hkv, 1, Dh).float())  # (B, Hkv, G, 1, Dh)
    scores = (grouped * k[:, :, None].float()).sum(-1) * scale  # (B, Hkv, G, n)
    scores = scores.masked_fill(~mask, float("-inf"))  # mask (B, 1, 1, n) broadcast over the heads
    p = stored(torch.softmax(scores, dim=-1))
    out = (p[..., None] * v[:, :, None].float()).sum(-2)  # (B, Hkv, G, Dh)
    return out.reshape(B, H, 1, Dh).to(q.dtype)
