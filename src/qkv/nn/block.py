"""One Transformer layer: self-attention, optional cross-attention, FFN, each inside a residual.

Encoder and decoder layers are this one class (STYLE.md 7): a decoder layer of an encoder-decoder
model has `cross_attn`; the residual placement (pre / post) is a function from nn.residual.
"""
from __future__ import annotations

from typing import Callable

from torch import Tensor, nn

from qkv.nn.attention import Attention, AttentionContext
from qkv.nn.cache import LayerCache
from qkv.nn.hookpoints import point


class Block(nn.Module):
    hook_points = ("resid_pre", "resid_mid", "resid_post")  # qkv.nn.hookpoints
    def __init__(self, *, attn: Attention, ffn: nn.Module, attn_norm: nn.Module, ffn_norm: nn.Module,
                 residual: Callable, cross_attn: Attention | None = None, cross_norm: nn.Module | None = None):
        super().__init__()
        self.attn_norm, self.attn = attn_norm, attn
        self.cross_norm, self.cross_attn = cross_norm, cross_attn
        self.ffn_norm, self.ffn = ffn_norm, ffn
        self.residual = residual

    def forward(self, x: Tensor, ctx: AttentionContext, cache: LayerCache | None = None,
                memory: Tensor | None = None, memory_ctx: AttentionContext | None = None,
                memory_cache: LayerCache | None = None) -> Tensor:
        """`memory_cache` keeps the cross-attention K/V of the encoder output between decoding steps
        (qkv.models.encoder_decoder.MemoryCache)."""
        x = point(self, "resid_pre", x)  # qkv.nn.hookpoints
        x = self.residual(x, self.attn_norm, self.attn, ctx, cache)
        if self.cross_attn is not None:
            x = self.residual(x, self.cross_norm, self.cross_attn, memory_ctx, memory_cache, memory)
        x = point(self, "resid_mid", x)
        x = self.residual(x, self.ffn_norm, self.ffn)
        return point(self, "resid_post", x)
