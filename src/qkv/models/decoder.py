"""Decoder-only language model (GPT/LLaMA style; note 000 LLM part §1-2, note 003).

    H0 = E[x] s + P        (token embedding = one-hot(x) W_E, note 000 LLM §2.1; qkv.nn.embedding; s = sqrt(D)
                           with model.embed_scale (Gemma), else 1)
                           (+ E_2[h(x_{t-1}, x_t)] with model.bigram_vocab: the hashed bigram table)
    H^l = Block^l(H^{l-1})  for l = 1..L  (causal self-attention + FFN)
    logits = LN(H^L) W_out  (W_out = W_E^T when tied)
"""
from __future__ import annotations

import torch
from torch import Tensor, nn

from qkv.models.context import document_positions, self_context
from qkv.nn.block import Block
from qkv.nn.cache import KVCache, rolling_window
from qkv.nn.embedding import Embeddings, activations_of, last_tokens, previous_tokens
from qkv.nn.hookpoints import point
from qkv.nn.positional import Positional


class DecoderLM(Embeddings):
    hook_points = ("embed", "final_norm", "logits")  # qkv.nn.hookpoints (the blocks add theirs)
    def __init__(self, *, tok_emb: nn.Embedding, positional: Positional, blocks: list[Block],
                 final_norm: nn.Module, lm_head: nn.Linear, dropout: float, max_seq_len: int,
                 bigram_emb: nn.Embedding | None = None, embed_scale: bool = False):
        super().__init__()
        self.set_embeddings(tok_emb, positional, dropout, bigram_emb=bigram_emb, embed_scale=embed_scale)
        self.blocks = nn.ModuleList(blocks)
        self.final_norm = final_norm
        self.lm_head = lm_head  # W_out (V, D), the same tensor as W_E when tied
        self.max_seq_len = max_seq_len
        self.kv_dtype: torch.dtype | None = None  # the caches' dtype when not the embedding's (inference)

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None,
                cache: KVCache | None = None, *, head: bool = True, documents: Tensor | None = None,
                logits_to_keep: int = 0) -> Tensor:
        """(B, T) token ids -> (B, T, V) logits. `attention_mask` (B, T): 1 for tokens, 0 for padding.

        head=False: the final norm's output (B, T, D) instead, which the LM objective hands to the head and
        the loss taken together in row chunks (qkv.nn.linear_cross_entropy: the logits never exist whole).
        `documents` (B, T): the document index of each token of packed rows (qkv.models.context: positions
        restart and attention stays inside each document). `logits_to_keep` k > 0: only the last k positions
        go through the head, (B, k, V) (a prompt's prefill needs the last one's logits: the head is about a
        sixth of a 500-token prefill of SmolLM2)."""
        ctx = self_context(self.positional, input_ids, attention_mask, cache, causal=True, documents=documents)
        previous = None
        if self.bigram_emb is not None:  # the pair's first token may be the cache's last
            last = cache.last_token if cache is not None else None
            previous = previous_tokens(input_ids, attention_mask, last)
            if documents is not None:  # a document's first token has no previous token
                previous = previous.masked_fill(document_positions(documents) == 0, -1)
            if cache is not None:
                cache.last_token = last_tokens(input_ids, attention_mask, cache.last_token)
        x = point(self, "embed", self.embed(input_ids, ctx.positions, previous=previous))  # H0 (B, T, D)
        layers = cache.layers if cache is not None else [None] * len(self.blocks)
        for block, layer_cache in zip(self.blocks, layers):
            x = block(x, ctx, layer_cache)
        x = point(self, "final_norm", self.final_norm(x))  # (B, T, D)
        if logits_to_keep > 0:  # (B, k, D), strides made afresh: torch's bf16 product of the slice as it comes,
            x = x[:, -logits_to_keep:].clone(memory_format=torch.contiguous_format)  # strides (T D, D, 1), copied
            # the whole head (SmolLM2's: 48 against 3 ms)
        return point(self, "logits", self.lm_head(x)) if head else x  # (B, T, V) or (B, T, D)

    def new_cache(self, batch: int, max_len: int, *, rolling: bool = False, rings: bool | None = None) -> KVCache:
        """A preallocated KV cache for `batch` rows of up to `max_len` tokens; `rolling`: keep only the columns
        the kernel can still read (a local kernel's last w, any length) and `rings` (by default as `rolling`) each
        sliding layer's in a ring (qkv.nn.cache). Its keys and values are held in the embedding's dtype, or in
        `kv_dtype` where set (qkv.generate.weights.set_kv_dtype)."""
        attn = self.blocks[0].attn
        dtype, device = activations_of(self)
        rings = rolling if rings is None else rings
        windows = tuple(block.attn.sliding for block in self.blocks) if rings else ()  # (qkv.plan)
        heads, k_dim, v_dim = attn.cache_dims  # (latent attention: one key head of the latent, no values)
        return KVCache(len(self.blocks), batch, heads, max_len, k_dim, dtype=self.kv_dtype or dtype,
                       device=device, window=rolling_window(attn.kernel_name, attn.window) if rolling else 0,
                       layer_windows=windows, v_dim=v_dim)
