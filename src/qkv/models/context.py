"""What every attention layer of one forward pass shares (an `AttentionContext`), for the three families.

Self-attention (note 000 §7.2, §8.2): positions count real tokens only, so left or right padding never
moves a token's position; the mask combines key padding with the causal triangle where the stack is causal.
Packed documents (several sequences in one row, `documents` (B, T) the document index of each token, each
document one contiguous run): positions restart at 0 where a document starts, and a query sees only the keys of
its own document (causal within it), so each document's outputs equal those it gets alone in a row.
Cross-attention (note 000 §8.4): queries from the decoder, keys and values from the encoder output;
no positional hook acts on it and only source padding is masked.
"""
from __future__ import annotations

import torch
from torch import Tensor

from qkv.nn import masks
from qkv.nn.attention import AttentionContext
from qkv.nn.cache import KVCache
from qkv.nn.positional import Positional

NO_POSITIONS = Positional()  # identity hooks: cross-attention compares a target with a source position


def token_positions(input_ids: Tensor, attention_mask: Tensor | None, start: Tensor) -> tuple[Tensor, Tensor]:
    """(B, T) positions start + (index among the row's real tokens) and (B,) counts of real tokens."""
    B, T = input_ids.shape
    if attention_mask is None:
        offsets = torch.arange(T, device=input_ids.device)[None, :]  # (1, T)
        counts = torch.full_like(start, T)
    else:  # a row's position counts its real tokens only, so left padding shifts nothing
        offsets = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)  # (B, T)
        counts = attention_mask.long().sum(-1)
    return start[:, None] + offsets, counts  # (B, T), (B,)


def document_positions(documents: Tensor) -> Tensor:
    """(B, T) each token's index inside its document: the column minus the column where its document starts."""
    T = documents.shape[1]
    columns = torch.arange(T, device=documents.device).expand_as(documents)  # (B, T)
    starts = documents != documents.roll(1, dims=1)
    starts[:, 0] = True
    return columns - torch.where(starts, columns, 0).cummax(dim=1).values  # (B, T)


def document_mask(documents: Tensor, attention_mask: Tensor | None, *, causal: bool) -> Tensor:
    """(B, 1, T, T): query t may see key s iff both are in the same document (and s <= t when causal, and s is
    not padding); a query always sees its own column (qkv.nn.masks)."""
    T = documents.shape[1]
    allowed = documents[:, None, :, None] == documents[:, None, None, :]  # (B, 1, T, T)
    if causal:
        allowed = allowed & masks.causal_mask(T, T, documents.device)
    if attention_mask is not None:
        allowed = allowed & attention_mask.bool()[:, None, None, :]
    return allowed | torch.eye(T, dtype=torch.bool, device=documents.device)


def self_context(positional: Positional, input_ids: Tensor, attention_mask: Tensor | None,
                 cache: KVCache | None, *, causal: bool, documents: Tensor | None = None) -> AttentionContext:
    """Self-attention over this call's tokens and the cached ones; `attention_mask` (B, T) 1 = token;
    `documents` (B, T): packed documents (training: no cache)."""
    B, T = input_ids.shape
    if documents is not None:
        if cache is not None:
            raise ValueError("packed documents are a training input; a KV cache holds one sequence per row")
        positions = document_positions(documents)
        mask = document_mask(documents, attention_mask, causal=causal)
        return AttentionContext(positional, positions, positions, mask, causal=False)
    start = cache.next_position if cache is not None else torch.zeros(B, dtype=torch.long,
                                                                       device=input_ids.device)
    positions, counts = token_positions(input_ids, attention_mask, start)
    key_positions, key_padding = positions, attention_mask
    if cache is not None:
        cache.next_position = start + counts
        key_positions, key_padding = cache.extend(positions, attention_mask)
    mask = masks.attention_mask(T, key_padding, causal=causal, device=input_ids.device)
    return AttentionContext(positional, positions, key_positions, mask, causal=causal and mask is None)


def cross_context(positions: Tensor, memory_padding: Tensor | None, memory_len: int) -> AttentionContext:
    """Queries at `positions` (B, T) over all `memory_len` encoder outputs, minus source padding (B, S).

    Unlike self-attention, no query gets its own column back: a padded source position is never seen.
    """
    B, T = positions.shape
    mask = None
    if memory_padding is not None:
        mask = memory_padding.bool()[:, None, None, :].expand(B, 1, T, memory_len)  # (B, 1, T, S)
    key_positions = torch.arange(memory_len, device=positions.device).expand(B, memory_len)  # (B, S)
    return AttentionContext(NO_POSITIONS, positions, key_positions, mask, causal=False)
