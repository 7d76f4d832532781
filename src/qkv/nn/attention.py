"""Multi-head attention (note 000 §2.2): MHA, GQA and MQA are one module, chosen by n_kv_heads.

head_i = Attention(X W_i^Q, X W_i^K, X W_i^V);  MultiHead(X) = Concat(head_1..head_H) W^O.
With n_kv_heads < n_heads, groups of n_heads / n_kv_heads query heads share one key/value head
(GQA; MQA when n_kv_heads = 1). Cross-attention (note 000 §8.4) takes keys and values from `memory`.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from qkv.nn.cache import LayerCache
from qkv.nn.fastpath import fused_or_none
from qkv.nn.hookpoints import point, wants
from qkv.nn.kernels import kernel_for, weighted_values, weights_for
from qkv.nn.norms import RMSNorm
from qkv.nn.positional import Positional


@dataclass
class AttentionContext:
    """What every attention layer of one forward pass shares."""

    positional: Positional  # its rotate / score_bias / value_bias hooks (identity for cross-attention)
    positions: Tensor  # (B, T) positions of this call's queries (and of its new keys)
    key_positions: Tensor  # (B, S) positions of every key, cached ones included
    mask: Tensor | None  # (B, 1, T, S) bool, True where attention is allowed
    causal: bool  # the kernel applies the causal triangle itself (mask is None)


class Attention(nn.Module):
    hook_points = ("q", "k", "v", "scores", "pattern", "z", "out")  # qkv.nn.hookpoints
    def __init__(self, d_model: int, n_heads: int, n_kv_heads: int, *, kernel: str, bias: bool,
                 dropout: float = 0.0, window: int = 0, qk_norm_eps: float | None = None, head_dim: int = 0,
                 sliding: int = 0, scale: float = 0.0, softcap: float = 0.0, positional: Positional | None = None,
                 qk_norm_whole: bool = False, sinks: bool = False):
        """`head_dim`: Dh where it is not D / H; `sliding` W > 0: each query sees its last W keys (itself
        included: a sliding layer of qkv.plan); `scale`: the scores' factor where it is not Dh^-1/2;
        `softcap` c > 0: scores c tanh(s / c) before the mask (Gemma 2); `positional`: the layer's own rotation
        where it differs from the model's (a local RoPE base, or none: qkv.plan); `qk_norm_whole`: the q/k norm
        over all heads' features at once (OLMo 2, OLMoE) rather than each head's."""
        super().__init__()
        self.n_heads, self.n_kv_heads = n_heads, n_kv_heads
        self.head_dim = head_dim or d_model // n_heads
        self.sliding, self.scale, self.softcap = sliding, scale or self.head_dim ** -0.5, softcap
        self.positional = positional  # None: the model's encoding (ctx.positional)
        self.kernel_name, self.window = kernel, window  # record_attention rebuilds the kernel's weights
        self.kernel = kernel_for(kernel, window=window)  # the sparse kinds get their window bound here
        self.q_proj = nn.Linear(d_model, n_heads * self.head_dim, bias=bias)  # W^Q (H*Dh, D)
        self.k_proj = nn.Linear(d_model, n_kv_heads * self.head_dim, bias=bias)  # W^K (Hkv*Dh, D)
        self.v_proj = nn.Linear(d_model, n_kv_heads * self.head_dim, bias=bias)  # W^V (Hkv*Dh, D)
        self.o_proj = nn.Linear(n_heads * self.head_dim, d_model, bias=bias)  # W^O (D, H*Dh)
        # QK-norm (Dehghani et al. 2023; OLMo 2, Qwen3, modded-nanogpt): q_h <- RMSNorm(q_h), k_h <- RMSNorm(k_h)
        # over each head's Dh features, one learnt gain per feature shared by the heads; bounds the logits.
        # qk_norm_whole: q <- RMSNorm(q), k <- RMSNorm(k) over all H*Dh (Hkv*Dh) features, a gain for each
        qk = qk_norm_eps is not None
        self.qk_norm_whole = qk and qk_norm_whole
        q_width, k_width = (n_heads * self.head_dim, n_kv_heads * self.head_dim) if qk_norm_whole else (self.head_dim,) * 2
        self.q_norm = RMSNorm(q_width, eps=qk_norm_eps) if qk else None
        self.k_norm = RMSNorm(k_width, eps=qk_norm_eps) if qk else None
        # attention sinks (gpt-oss): a learnt logit per head in the softmax's denominator (qkv.nn.kernels)
        self.sinks = nn.Parameter(torch.zeros(n_heads)) if sinks else None
        self.attn_dropout = dropout
        self.dropout = nn.Dropout(dropout) if dropout else nn.Identity()  # p = 0: no dropout kernel at all

    @property
    def cache_dims(self) -> tuple[int, int, int]:
        """(key heads, key width, value width) of its KV cache."""
        return self.n_kv_heads, self.head_dim, self.head_dim

    def forward(self, x: Tensor, ctx: AttentionContext, cache: LayerCache | None = None,
                memory: Tensor | None = None) -> Tensor:
        B, T, _ = x.shape
        source = x if memory is None else memory  # (B, S_new, D)
        fused = None if memory is not None else fused_or_none(self, "fused_qkv", self.q_proj, self.k_proj,
                                                               self.v_proj)
        if fused is not None:  # [Q K V] = x [W^Q; W^K; W^V]^T in one product (qkv.nn.fuse, inference)
            kv = self.n_kv_heads * self.head_dim
            q, k, v = fused(x).split((self.n_heads * self.head_dim, kv, kv), dim=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(source), self.v_proj(source)  # (B, T, H*Dh), (B, S_new, Hkv*Dh)
        if self.qk_norm_whole:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = (self.split_heads(q, self.n_heads), self.split_heads(k, self.n_kv_heads),
                   self.split_heads(v, self.n_kv_heads))  # (B, H, T, Dh), (B, Hkv, S_new, Dh)
        if self.q_norm is not None and not self.qk_norm_whole:
            q, k = self.q_norm(q), self.k_norm(k)  # before the rotation, which keeps the norm
        q, k = (self.positional or ctx.positional).rotate(q, k, ctx.positions)
        q, k, v = point(self, "q", q), point(self, "k", k), point(self, "v", v)  # qkv.nn.hookpoints
        if cache is not None:
            k, v = cache.append(k, v)  # (B, Hkv, S, Dh), in the cache's dtype (fp16 or bf16 for an fp32 model)
            k, v = (k, v) if k.dtype == q.dtype else (k.to(q.dtype), v.to(q.dtype))
        # a kernel that takes grouped K/V repeats nothing, unless the score bias is made from K (Shaw, XL)
        if not getattr(self.kernel, "grouped_kv", False) or ctx.positional.score_bias_kind == "content":
            k, v = self.repeat_kv(k), self.repeat_kv(v)  # (B, H, S, Dh)
        bias = ctx.positional.score_bias(ctx.positions, ctx.key_positions, q, k)  # (B, H, T, S) or None
        value_bias = ctx.positional.value_bias(ctx.positions, ctx.key_positions)
        dropout = self.attn_dropout if self.training else 0.0
        columns = getattr(cache, "columns", None)  # a ring's kept columns and this call's (qkv.nn.cache)
        mask, causal = ((ctx.mask, ctx.causal) if not self.sliding else
                        (sliding_mask(ctx, self.sliding, q.device, columns), False))
        if wants(self, "scores") or wants(self, "pattern") or self.softcap or self.sinks is not None:  # A formed
            if k.shape[1] != q.shape[1]:
                k, v = self.repeat_kv(k), self.repeat_kv(v)
            weights = weights_for(self.kernel_name, window=self.window)
            capped = {"softcap": self.softcap} if self.softcap else {}  # (a dense kernel: qkv.models.build)
            capped.update({"sinks": self.sinks} if self.sinks is not None else {})
            pattern = weights(q, k, mask=mask, causal=causal, bias=bias, scale=self.scale,
                              on_scores=lambda scores: point(self, "scores", scores), **capped)  # (B, H, T, S)
            out = weighted_values(point(self, "pattern", pattern), v, value_bias, dropout)
        else:
            out = self.kernel(q, k, v, mask=mask, causal=causal, bias=bias, value_bias=value_bias,
                              scale=self.scale, dropout=dropout)  # (B, H, T, Dh)
        out = point(self, "z", out)
        out = out.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim)  # concat heads (B, T, H*Dh)
        return self.dropout(point(self, "out", self.o_proj(out)))  # (B, T, D)

    def extra_repr(self) -> str:
        parts = [f"heads={self.n_heads}, kv_heads={self.n_kv_heads}, head_dim={self.head_dim}"]
        parts += [f"sliding={self.sliding}"] if self.sliding else []
        return ", ".join(parts + ([f"softcap={self.softcap}"] if self.softcap else []))

    def split_heads(self, x: Tensor, heads: int) -> Tensor:  # (B, T, heads*Dh) -> (B, heads, T, Dh)
        B, T, _ = x.shape
        return x.view(B, T, heads, self.head_dim).transpose(1, 2)

    def repeat_kv(self, x: Tensor) -> Tensor:  # (B, Hkv, S, Dh) -> (B, H, S, Dh)
        groups = self.n_heads // self.n_kv_heads
        return x if groups == 1 else x.repeat_interleave(groups, dim=1)


def sliding_mask(ctx: AttentionContext, window: int, device, columns: Tensor | None = None) -> Tensor:
    """(B, 1, T, S) the context's mask (or causal triangle) with each query's keys cut to the last `window`
    positions, itself included: key position p_j > p_i - W (qkv.plan's sliding layer). `columns` (S',): the
    columns of the keys a ring cache returned (qkv.nn.cache), of all S the context covers: (B, 1, T, S')."""
    T, S = ctx.positions.shape[1], ctx.key_positions.shape[1]
    cols = torch.arange(S, device=device) if columns is None else columns
    near = ctx.key_positions[:, None, None, cols] > ctx.positions[:, None, :, None] - window  # (B, 1, T, S')
    if ctx.mask is not None:
        return ctx.mask[..., cols] & near
    if ctx.causal:
        return (cols[None, :] <= torch.arange(S - T, S, device=device)[:, None]) & near
    return near
