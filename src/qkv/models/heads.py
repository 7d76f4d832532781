"""Heads on an encoder (BERT, Devlin et al. 2019; note 003: encoders are for understanding and classification).

Each model wraps a bare `Encoder` and one head, so the encoder's weights are the same tensors under every
head (an MLM-pretrained encoder is fine-tuned by wrapping it in a classifier):

    EncoderMLM:        logits = LN(act(H W_t + b_t)) W_E^T + b_V        (B, T, V); W_E tied when tie_embeddings
    EncoderClassifier: logits = tanh(pool(H) W_p + b_p) W_c + b_c      (B, n_classes)

pool is a registry (`model.pooling`): `first` (the first token's state, BERT's [CLS]) or `mean` (the mean
over unpadded tokens).
"""
from __future__ import annotations

from typing import Callable

from torch import Tensor, nn

from qkv.models.encoder import Encoder
from qkv.registry import Registry

POOLINGS: Registry[Callable[[Tensor, Tensor | None], Tensor]] = Registry("pooling")


@POOLINGS.register("first")
def first_token(hidden: Tensor, attention_mask: Tensor | None) -> Tensor:
    """h_0 (BERT's [CLS] position): (B, T, D) -> (B, D). Rows must not be left-padded."""
    return hidden[:, 0]


@POOLINGS.register("mean")
def mean_over_tokens(hidden: Tensor, attention_mask: Tensor | None) -> Tensor:
    """(1 / n_b) sum_t m_bt h_bt over the n_b real tokens of each row: (B, T, D) -> (B, D)."""
    if attention_mask is None:
        return hidden.mean(dim=1)
    weights = attention_mask.to(hidden.dtype)[..., None]  # (B, T, 1)
    return (hidden * weights).sum(dim=1) / weights.sum(dim=1).clamp(min=1)


class MLMHead(nn.Module):
    """BERT's prediction head: a dense transform, the activation and a norm, then the vocabulary projection
    (sharing W_E when tied) with its own bias."""

    def __init__(self, *, transform: nn.Linear, activation: Callable, norm: nn.Module, decoder: nn.Linear):
        super().__init__()
        self.transform = transform  # W_t (D, D)
        self.activation = activation
        self.norm = norm
        self.decoder = decoder  # W_V (V, D) = W_E when tied, bias b_V (V,)

    def forward(self, hidden: Tensor) -> Tensor:  # (B, T, D) -> (B, T, V)
        return self.decoder(self.features(hidden))

    def features(self, hidden: Tensor) -> Tensor:  # (..., D) -> (..., D): what the decoder projects
        return self.norm(self.activation(self.transform(hidden)))


class ClassifierHead(nn.Module):
    """Pooling, BERT's pooler (dense + tanh), dropout, then the class projection."""

    def __init__(self, *, pool: Callable, pooler: nn.Linear, out_proj: nn.Linear, dropout: float):
        super().__init__()
        self.pool = pool
        self.pooler = pooler  # W_p (D, D)
        self.dropout = nn.Dropout(dropout)
        self.out_proj = out_proj  # W_c (n_classes, D)

    def forward(self, hidden: Tensor, attention_mask: Tensor | None) -> Tensor:  # (B, T, D) -> (B, C)
        pooled = self.pooler(self.pool(hidden, attention_mask)).tanh()  # (B, D)
        return self.out_proj(self.dropout(pooled))


class EncoderMLM(nn.Module):
    """Masked language model: `model(input_ids, attention_mask=mask)` -> (B, T, V) logits.

    head=False: the encoder's hidden states (B, T, D) instead; the MLM objective runs the head on the
    masked positions only (the head acts on each position alone, so the loss and every gradient are the
    same, for about 15% of the head's work) and the vocabulary projection and the loss in row chunks
    (qkv.nn.linear_cross_entropy).
    """

    def __init__(self, encoder: Encoder, head: MLMHead):
        super().__init__()
        self.encoder, self.head = encoder, head

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None,
                token_type_ids: Tensor | None = None, *, head: bool = True) -> Tensor:
        hidden = self.encoder(input_ids, attention_mask, token_type_ids)  # (B, T, D)
        return self.head(hidden) if head else hidden  # (B, T, V) or (B, T, D)


class EncoderClassifier(nn.Module):
    """Sequence classifier: `model(input_ids, attention_mask=mask)` -> (B, n_classes) logits."""

    def __init__(self, encoder: Encoder, head: ClassifierHead):
        super().__init__()
        self.encoder, self.head = encoder, head

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None,
                token_type_ids: Tensor | None = None) -> Tensor:
        return self.head(self.encoder(input_ids, attention_mask, token_type_ids), attention_mask)
