"""Attention masks (note 000 §8.2): which keys each query may see.

A mask is boolean, True where attention is allowed, shaped (B, 1, T, S). Queries are the last T of
S key columns (a KV cache holds the first S - T), so query t sits at column S - T + t.
"""
from __future__ import annotations

import torch
from torch import Tensor


def causal_mask(T: int, S: int, device=None) -> Tensor:
    """M[t, s] = s <= S - T + t: the lower triangle aligned to the bottom-right corner. (T, S)"""
    rows = torch.arange(T, device=device)[:, None] + (S - T)
    return torch.arange(S, device=device)[None, :] <= rows


def attention_mask(T: int, key_padding: Tensor | None, causal: bool, device=None) -> Tensor | None:
    """Combine causality and key padding (B, S) into (B, 1, T, S); None when nothing is masked.

    A padded query (a left-pad slot) could otherwise see no key at all and give NaN, so every
    query may always see its own column; its output is never used.
    """
    if key_padding is None:
        return None
    S = key_padding.shape[1]
    allowed = key_padding[:, None, None, :].bool()  # (B, 1, 1, S)
    if causal:
        allowed = allowed & causal_mask(T, S, device)
    own_column = torch.arange(S, device=device)[None, :] == (torch.arange(T, device=device)[:, None] + S - T)
    return allowed | own_column
