"""The embedding equation of all three families, written once (note 000 LLM §2.1; note 000 §3, §18):

    H0 = Dropout(Norm_emb(P(E[x] * s + T[type])))

E[x] = one-hot(x) W_E, the token embedding (W_E (V, D)); s = sqrt(D) with embed_scale (Vaswani et al.
§3.4), else 1; T[type] the token-type (segment) rows (BERT; none elsewhere); P the positional encoding's
`embed` hook (adds an absolute table, or the identity for relative and rotary encodings); Norm_emb the
embedding norm (BERT) or the identity. The decoder-only model has s = 1, no types and no norm: H0 = E[x] + P.

`Embeddings` is a mixin rather than a submodule so the parameters keep their names on the model itself
(tok_emb.weight, type_emb.weight, embed_norm.*, positional.*): checkpoints, Hugging Face conversion and the
reference engine's names stay the same for every family.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from qkv.nn.positional import Positional


class Embeddings(nn.Module):
    tok_emb: nn.Embedding
    positional: Positional

    def set_embeddings(self, tok_emb: nn.Embedding, positional: Positional, dropout: float, *,
                       type_emb: nn.Embedding | None = None, embed_norm: nn.Module | None = None,
                       embed_scale: bool = False) -> None:
        """Register the embedding's modules on the model, under the names every engine and format uses."""
        self.tok_emb = tok_emb  # W_E (V, D)
        self.type_emb = type_emb  # token types (segments) (type_vocab_size, D), or None
        self.positional = positional
        self.embed_norm = embed_norm if embed_norm is not None else nn.Identity()
        self.embed_scale = math.sqrt(tok_emb.embedding_dim) if embed_scale else 1.0
        self.dropout = nn.Dropout(dropout) if dropout else nn.Identity()  # p = 0: no dropout kernel at all

    def embed(self, input_ids: Tensor, positions: Tensor, token_type_ids: Tensor | None = None) -> Tensor:
        """(B, T) ids at (B, T) positions -> H0 (B, T, D)."""
        x = self.tok_emb(input_ids)  # E[x]   (B, T, D)
        if self.embed_scale != 1.0:
            x = x * self.embed_scale
        if self.type_emb is not None:
            types = token_type_ids if token_type_ids is not None else torch.zeros_like(input_ids)
            x = x + self.type_emb(types)
        return self.dropout(self.embed_norm(self.positional.embed(x, positions)))  # (B, T, D)
