"""Encoder stack (BERT style; note 000 §7, §18.1; note 003 "Encoder-only ... 理解、分类"):

    H0 = Dropout(Norm_emb(E[x] * s + P + T[type]))   (s = sqrt(D) with embed_scale; Norm_emb with embed_norm)
    H^l = Block^l(H^{l-1})  for l = 1..L              (bidirectional self-attention + FFN, no causal mask)
    hidden = Norm_f(H^L)                              (Pre-LN stacks; Post-LN blocks already end in a norm)

`model(input_ids, attention_mask=mask)` returns the hidden states (B, T, D); heads (MLM, classifier)
are separate modules wrapping an encoder (qkv.models.heads). The encoder-decoder model reuses this
class for its encoder.
"""
from __future__ import annotations

from torch import Tensor, nn

from qkv.models.context import self_context
from qkv.nn.block import Block
from qkv.nn.embedding import Embeddings
from qkv.nn.hookpoints import point
from qkv.nn.positional import Positional


class Encoder(Embeddings):
    hook_points = ("embed", "final_norm")  # qkv.nn.hookpoints (the blocks add theirs)

    def __init__(self, *, tok_emb: nn.Embedding, positional: Positional, blocks: list[Block],
                 final_norm: nn.Module, dropout: float, type_emb: nn.Embedding | None = None,
                 embed_norm: nn.Module | None = None, embed_scale: bool = False):
        super().__init__()
        self.set_embeddings(tok_emb, positional, dropout, type_emb=type_emb, embed_norm=embed_norm,
                            embed_scale=embed_scale)
        self.blocks = nn.ModuleList(blocks)
        self.final_norm = final_norm

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None,
                token_type_ids: Tensor | None = None) -> Tensor:
        """(B, T) ids -> (B, T, D) hidden states. `attention_mask` (B, T): 1 for tokens, 0 for padding;
        `token_type_ids` (B, T) default to type 0 when the model has token types."""
        ctx = self_context(self.positional, input_ids, attention_mask, None, causal=False)
        x = point(self, "embed", self.embed(input_ids, ctx.positions, token_type_ids))  # H0 (B, T, D)
        for block in self.blocks:
            x = block(x, ctx)
        return point(self, "final_norm", self.final_norm(x))  # (B, T, D)
