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
           n: int, mask: Tensor, ring: int = 0) -> Tensor:
    """One layer's self-attention for the new columns n - T .. n - 1: (B, T, D) -> (B, T, D). `ring` > 0: the
    cache is a sliding layer's ring of that many slots (column c in slot c mod ring, qkv.nn.cache), its first
    min(n, ring) slots attended under `mask` (B, 1, T, min(n, ring))."""
    B, T = h.shape[:2]
    H, Hkv, Dh = attn.n_heads, attn.n_kv_heads, attn.head_dim
    fused = fused_or_none(attn, "fused_qkv", attn.q_proj, attn.k_proj, attn.v_proj)
    if fused is not None:
        q, k, v = fused(h).split((H * Dh, Hkv * Dh, Hkv * Dh), dim=-1)
    else:
        q, k, v = attn.q_proj(h), attn.k_proj(h), attn.v_proj(h)
    if attn.qk_norm_whole:  # over all heads' features (OLMoE)
        q, k = attn.q_norm(q), attn.k_norm(k)
    if T == 1:  # one column: no transpose
        q, k, v = q.view(B, H, 1, Dh), k.view(B, Hkv, 1, Dh), v.view(B, Hkv, 1, Dh)
    else:  # (B, heads, T, Dh)
        q, k, v = (t.view(B, T, t.shape[-1] // Dh, Dh).transpose(1, 2) for t in (q, k, v))
    if attn.q_norm is not None and not attn.qk_norm_whole:
        q, k = attn.q_norm(q), attn.k_norm(k)
    if rope is not None:
        q, k = rotate_half(q, *rope), rotate_half(k, *rope)
    if ring:  # into the ring's slots, in place
        slots = torch.arange(n - T, n, device=k.device) % ring
        k_all.index_copy_(2, slots, k.to(k_all.dtype))
        v_all.index_copy_(2, slots, v.to(v_all.dtype))
    elif T == 1:  # into the preallocated cache, in place
        k_all[:, :, n - 1:n] = k
        v_all[:, :, n - 1:n] = v
    else:  # (by index: a slice from n - T would guard on where it starts, n - T <= 0 when traced into an empty cache)
        own = torch.arange(n - T, n, device=k.device)
        k_all.index_copy_(2, own, k.to(k_all.dtype))  # (a cache in fp16 or bf16 under an fp32 model)
        v_all.index_copy_(2, own, v.to(v_all.dtype))
    if ring:  # its first min(n, ring) slots, those written (the rest are not until the ring wraps), gathered: a
        used = torch.arange(torch.sym_min(n, ring), device=k.device)  # slice would ask whether it is the whole
        k_seen, v_seen = k_all.index_select(2, used), v_all.index_select(2, used)  # ring, and recompile when so
    else:
        k_seen, v_seen = k_all[:, :, :n], v_all[:, :, :n]
    if attn.softcap:  # scores c tanh(s / c) before the mask (Gemma 2): formed explicitly
        out = capped_attention(q, k_seen, v_seen, mask, attn.scale, attn.softcap)
    elif summed_rows(h):  # one row on a CPU where sums inductor writes are the faster (qkv.nn.decoding_linear)
        out = summed_attention(q, k_seen, v_seen, mask, attn.scale)
    else:
        k_seen, v_seen = k_seen.to(q.dtype), v_seen.to(q.dtype)
        out = F.scaled_dot_product_attention(q, k_seen, v_seen, attn_mask=mask, scale=attn.scale,
                                             enable_gqa=H != Hkv)  # (B, H, T, Dh)
    return attn.o_proj(out.reshape(B, 1, H * Dh) if T == 1 else out.transpose(1, 2).reshape(B, T, H * Dh))


def capped_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, scale: float, cap: float) -> Tensor:
    """softmax(c tanh(q K^T scale / c), masked) V with the K/V heads repeated for the query heads; fp32 inside."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1).float(), v.repeat_interleave(groups, 1).float()
    scores = cap * torch.tanh((q.float() @ k.transpose(-2, -1)) * scale / cap)  # (B, H, T, n)
    return (scores.masked_fill(~mask, float("-inf")).softmax(-1) @ v).to(q.dtype)


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
