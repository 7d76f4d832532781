"""Encoder stack (BERT style; note 000 §7, §18.1; note 003 "Encoder-only ... 理解、分类"):

    H0 = Dropout(Norm_emb(E[x] * s + P + T[type]))   (s = sqrt(D) with embed_scale; Norm_emb with embed_norm)
    H^l = Block^l(H^{l-1})  for l = 1..L              (bidirectional self-attention + FFN, no causal mask)
    hidden = Norm_f(H^L)                              (Pre-LN stacks; Post-LN blocks already end in a norm)

`model(input_ids, attention_mask=mask)` returns the hidden states (B, T, D); heads (MLM, classifier)
are separate modules wrapping an encoder (qkv.models.heads). The encoder-decoder model reuses this
class for its encoder.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from qkv.models.context import self_context
from qkv.nn.block import Block
from qkv.nn.positional import Positional


class Encoder(nn.Module):
    def __init__(self, *, tok_emb: nn.Embedding, positional: Positional, blocks: list[Block],
                 final_norm: nn.Module, dropout: float, type_emb: nn.Embedding | None = None,
                 embed_norm: nn.Module | None = None, embed_scale: bool = False):
        super().__init__()
        self.tok_emb = tok_emb  # W_E (V, D)
        self.type_emb = type_emb  # token types (segments) (type_vocab_size, D), or None
        self.positional = positional
        self.embed_norm = embed_norm if embed_norm is not None else nn.Identity()
        self.embed_scale = math.sqrt(tok_emb.embedding_dim) if embed_scale else 1.0
        self.dropout = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(blocks)
        self.final_norm = final_norm

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None,
                token_type_ids: Tensor | None = None) -> Tensor:
        """(B, T) ids -> (B, T, D) hidden states. `attention_mask` (B, T): 1 for tokens, 0 for padding;
        `token_type_ids` (B, T) default to type 0 when the model has token types."""
        ctx = self_context(self.positional, input_ids, attention_mask, None, causal=False)
        x = self.embed(input_ids, ctx.positions, token_type_ids)  # (B, T, D)
        for block in self.blocks:
            x = block(x, ctx)
        return self.final_norm(x)  # (B, T, D)

    def embed(self, input_ids: Tensor, positions: Tensor, token_type_ids: Tensor | None) -> Tensor:
        x = self.tok_emb(input_ids) * self.embed_scale  # (B, T, D)
        if self.type_emb is not None:
            types = token_type_ids if token_type_ids is not None else torch.zeros_like(input_ids)
            x = x + self.type_emb(types)
        return self.dropout(self.embed_norm(self.positional.embed(x, positions)))
