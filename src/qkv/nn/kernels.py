"""Attention kernels: one signature for all (STYLE.md 4).

    kernel(q, k, v, *, mask, causal, bias, scale, dropout) -> out
    q: (B, H, T, Dh); k, v: (B, H, S, Dh) (key/value heads already repeated for GQA/MQA)
    mask: (B, 1, T, S) bool, True where attention is allowed, or None
    causal: apply the causal triangle (bottom-right aligned) when mask is None
    bias: additive score bias broadcastable to (B, H, T, S), or None
    out: (B, H, T, Dh)

`naive` writes note 000 §2.1 / §8.2 out: softmax(Q K^T / sqrt(d_k) + M) V; every faster kernel is
tested against it.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from qkv.nn.masks import causal_mask
from qkv.registry import Registry

Kernel = Callable[..., Tensor]
KERNELS: Registry[Kernel] = Registry("attention kernel")


def attention_weights(q: Tensor, k: Tensor, *, mask: Tensor | None, causal: bool,
                      bias: Tensor | None, scale: float) -> Tensor:
    """A = softmax(Q K^T * scale + bias + M), M = -inf where masked (note 000 §2.1.3, §8.2). (B, H, T, S)"""
    T, S = q.shape[-2], k.shape[-2]
    wide = torch.promote_types(q.dtype, torch.float32)  # softmax in fp32 (fp64 stays fp64)
    scores = (q @ k.transpose(-2, -1)).to(wide) * scale  # (B, H, T, S)
    if bias is not None:
        scores = scores + bias
    if mask is None and causal:
        mask = causal_mask(T, S, q.device)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return scores.softmax(dim=-1)


@KERNELS.register("naive")
def naive(q: Tensor, k: Tensor, v: Tensor, *, mask: Tensor | None, causal: bool,
          bias: Tensor | None, scale: float, dropout: float = 0.0) -> Tensor:
    weights = attention_weights(q, k, mask=mask, causal=causal, bias=bias, scale=scale)
    weights = F.dropout(weights, p=dropout) if dropout else weights
    return weights.to(v.dtype) @ v  # (B, H, T, Dh)


@KERNELS.register("sdpa")
def sdpa(q: Tensor, k: Tensor, v: Tensor, *, mask: Tensor | None, causal: bool,
         bias: Tensor | None, scale: float, dropout: float = 0.0) -> Tensor:
    """torch's fused scaled_dot_product_attention (flash / memory-efficient kernels where available)."""
    T, S = q.shape[-2], k.shape[-2]
    is_causal = causal and mask is None and bias is None and T == S  # torch aligns is_causal top-left
    if causal and mask is None and not is_causal and T > 1:
        mask = causal_mask(T, S, q.device)
    attn_mask = mask
    if bias is not None:
        attn_mask = bias.to(q.dtype) if mask is None else bias.to(q.dtype).masked_fill(~mask, float("-inf"))
    return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=dropout,
                                          is_causal=is_causal, scale=scale)
