"""Encoder-decoder Transformer (Vaswani et al. 2017; note 000 §1.1, §7, §8, §18; note 003: BART, T5).

    H_enc = Encoder(src)                                       (note 000 §18.1; qkv.models.encoder)
    Y0 = Dropout(Norm_emb(E[y] * s + P))                       (the target embedding; E shared when tied)
    Y^l = Block^l(Y^{l-1}, H_enc)   for l = 1..L_dec           (note 000 §18.2: masked self-attention,
                                                                 cross-attention Q = Y W_Q, K = H_enc W_K,
                                                                 V = H_enc W_V (§8.4), FFN)
    logits = Norm_f(Y^L) W_out                                 (W_out = W_E when tied, as in the paper §3.4)

`model(src_ids, tgt_ids)` -> (B, T, V) teacher-forced logits. For generation: `memory = model.encode(src,
src_mask)`, `cache = model.new_cache(B, max_len)`, then `model(None, tgt, src_mask, memory=memory,
cache=cache)` once and `model(None, next_tokens, cache=cache)` per step. The cache holds the
self-attention K/V (as the decoder-only model's) and, per layer, the cross-attention K/V of the encoder
output, projected by the first cached call only.
"""
from __future__ import annotations

import torch
from torch import Tensor, nn

from qkv.models.context import cross_context, self_context
from qkv.models.encoder import Encoder
from qkv.nn.attention import AttentionContext
from qkv.nn.block import Block
from qkv.nn.cache import KVCache, rolling_window
from qkv.nn.embedding import Embeddings
from qkv.nn.hookpoints import point
from qkv.nn.positional import Positional


class MemoryCache:
    """One layer's cross-attention keys and values (B, Hkv, S, Dh): stored by the first call, which sees
    the whole encoder output; later calls pass an empty memory and `append` returns the stored ones."""

    def __init__(self):
        self.k: Tensor | None = None
        self.v: Tensor | None = None

    def append(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        if self.k is None:
            self.k, self.v = k, v
        return self.k, self.v

    def reorder(self, rows: Tensor) -> None:
        if self.k is not None:
            self.k, self.v = self.k[rows], self.v[rows]


class Seq2SeqCache(KVCache):
    """The decoder's self-attention KV cache plus the cross-attention K/V and the source padding."""

    def __init__(self, n_layers: int, batch: int, n_kv_heads: int, max_len: int, head_dim: int, *,
                 dtype=torch.float32, device=None, window: int = 0):
        super().__init__(n_layers, batch, n_kv_heads, max_len, head_dim, dtype=dtype, device=device,
                         window=window)
        self.cross = [MemoryCache() for _ in range(n_layers)]
        self.memory_len = 0  # S; 0 until the first call has stored the cross-attention K/V
        self.memory_padding: Tensor | None = None  # (B, S) 1 for source tokens, or None

    def reorder(self, rows: Tensor) -> None:
        super().reorder(rows)
        for layer in self.cross:
            layer.reorder(rows)
        if self.memory_padding is not None:
            self.memory_padding = self.memory_padding[rows]


class EncoderDecoder(Embeddings):
    hook_points = ("embed", "final_norm", "logits")  # the decoder's (qkv.nn.hookpoints; encoder.* the encoder's)

    def __init__(self, *, tok_emb: nn.Embedding, encoder: Encoder, positional: Positional, blocks: list[Block],
                 final_norm: nn.Module, lm_head: nn.Linear, dropout: float, max_seq_len: int,
                 embed_norm: nn.Module | None = None, embed_scale: bool = False):
        super().__init__()
        # the target embedding first, so a shared W_E is saved as tok_emb.weight
        self.set_embeddings(tok_emb, positional, dropout, embed_norm=embed_norm, embed_scale=embed_scale)
        self.encoder = encoder
        self.blocks = nn.ModuleList(blocks)  # each with cross_attn
        self.final_norm = final_norm
        self.lm_head = lm_head  # W_out (V, D)
        self.max_seq_len = max_seq_len

    def forward(self, src_ids: Tensor | None, tgt_ids: Tensor, src_mask: Tensor | None = None,
                tgt_mask: Tensor | None = None, *, memory: Tensor | None = None,
                cache: Seq2SeqCache | None = None, head: bool = True) -> Tensor:
        """(B, S) source and (B, T) target ids -> (B, T, V) logits; masks (B, S), (B, T): 1 = token.

        Target t sees targets <= t and every source token. `memory` (B, S, D) is a precomputed
        `encode(src_ids, src_mask)`; a cache that already holds the cross-attention K/V needs neither.
        head=False: the decoder's hidden states (B, T, D) instead, which the seq2seq objective projects on
        the target rows only, with the loss, in row chunks (qkv.nn.linear_cross_entropy)."""
        if memory is None and (cache is None or not cache.memory_len):
            memory = self.encode(src_ids, src_mask)
        hidden = self.decode_hidden(tgt_ids, memory, src_mask, tgt_mask, cache)  # (B, T, D)
        return point(self, "logits", self.lm_head(hidden)) if head else hidden  # (B, T, V) or (B, T, D)

    def encode(self, src_ids: Tensor, src_mask: Tensor | None = None) -> Tensor:
        """(B, S) source ids -> H_enc (B, S, D)."""
        return self.encoder(src_ids, src_mask)

    def decode(self, tgt_ids: Tensor, memory: Tensor | None, src_mask: Tensor | None = None,
               tgt_mask: Tensor | None = None, cache: Seq2SeqCache | None = None) -> Tensor:
        """(B, T) target ids attending to `memory` (B, S, D) -> (B, T, V) logits."""
        return point(self, "logits", self.lm_head(self.decode_hidden(tgt_ids, memory, src_mask, tgt_mask, cache)))

    def decode_hidden(self, tgt_ids: Tensor, memory: Tensor | None, src_mask: Tensor | None = None,
                      tgt_mask: Tensor | None = None, cache: Seq2SeqCache | None = None) -> Tensor:
        """The decoder stack's final hidden states (B, T, D), before the head."""
        ctx = self_context(self.positional, tgt_ids, tgt_mask, cache, causal=True)
        x = point(self, "embed", self.embed(tgt_ids, ctx.positions))  # Y0 (B, T, D)
        memory, memory_ctx = self.memory_context(memory, src_mask, ctx.positions, cache)
        n = len(self.blocks)
        self_caches, cross_caches = (cache.layers, cache.cross) if cache is not None else ([None] * n, [None] * n)
        for block, self_cache, cross_cache in zip(self.blocks, self_caches, cross_caches):
            x = block(x, ctx, self_cache, memory, memory_ctx, cross_cache)
        return point(self, "final_norm", self.final_norm(x))  # (B, T, D)

    def memory_context(self, memory: Tensor | None, src_mask: Tensor | None, positions: Tensor,
                       cache: Seq2SeqCache | None) -> tuple[Tensor, AttentionContext]:
        """The encoder output the cross-attention reads and its context. Once a cache holds the
        cross-attention K/V, the memory is empty (B, 0, D): no layer projects the encoder output again."""
        if cache is None:
            return memory, cross_context(positions, src_mask, memory.shape[1])
        if not cache.memory_len:  # the first cached call stores K/V (in the blocks) and the source padding
            cache.memory_len, cache.memory_padding = memory.shape[1], src_mask
            return memory, cross_context(positions, src_mask, memory.shape[1])
        empty = self.tok_emb.weight.new_zeros(positions.shape[0], 0, self.tok_emb.embedding_dim)  # (B, 0, D)
        return empty, cross_context(positions, cache.memory_padding, cache.memory_len)

    def new_cache(self, batch: int, max_len: int, *, rolling: bool = False) -> Seq2SeqCache:
        """A preallocated decoder cache for `batch` rows of up to `max_len` target tokens; `rolling`: keep
        only the self-attention columns the kernel can still read (a local kernel's last w; qkv.nn.cache)."""
        attn = self.blocks[0].attn
        weight = self.tok_emb.weight
        return Seq2SeqCache(len(self.blocks), batch, attn.n_kv_heads, max_len, attn.head_dim,
                            dtype=weight.dtype, device=weight.device,
                            window=rolling_window(attn.kernel_name, attn.window) if rolling else 0)
