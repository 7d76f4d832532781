"""Sparse attention kernels (note 000 §15.1): each is softmax attention restricted to a pattern of keys,
a function of (query column i, key column j) only, so a KV-cache step sees the same keys as the full pass.

- `local`   |i - j| <= w (§15.1.1), computed per query block against its band of keys: O(T (b + 2w))
            scores and time, b = the block (w), never a (T, S) array (SPEC claim 16).
- `dilated` (i - j) mod d = 0 (§15.1.2: "j = i + k d, k in Z"), d = w; every key of the query's residue
            class, as the note writes it (no window). Each class attends densely within itself (tiled):
            O(n) memory, n^2 / d scores and time.
- `random`  BigBird-style (Zaheer et al. 2020; §15.1.3 "r random positions per query"): the window
            |i - j| <= w, plus the first GLOBAL_KEYS keys the query may see (global tokens), plus keys at
            RANDOM_KEYS seeded random distances in (w, w + RANDOM_SPAN]. Distances, not absolute
            blocks, so left padding and cached decoding see the same keys (docs/DEVIATIONS.md). Without a
            padding mask, banded like local (reach w + RANDOM_SPAN) plus the global columns: O(n (w +
            RANDOM_SPAN)); with one (each row's own first keys are global), the tiled sweep.

w is `model.window`, bound by `kernel_for`. Combined with causality and padding masks as every kernel is.
"""
from __future__ import annotations

import functools
import math
from typing import Callable

import torch
from torch import Tensor

from qkv.nn.flash import tiled
from qkv.nn.kernels import KERNELS, KernelSpec, RelativeValues, attention_weights, weighted_values

GLOBAL_KEYS = 2  # BigBird's global tokens: the first keys every query attends to
RANDOM_KEYS = 3  # BigBird's r random keys (3 random blocks in the paper)
RANDOM_SPAN = 32  # random distances are drawn from (w, w + RANDOM_SPAN]
RANDOM_SEED = 0  # the pattern is part of the model: the same in every step, process and run


def offsets(query_cols: Tensor, key_cols: Tensor) -> Tensor:
    """i - j for every (query, key) column pair. (r, c)"""
    return query_cols[:, None] - key_cols[None, :]


def local_pattern(query_cols: Tensor, key_cols: Tensor, *, window: int) -> Tensor:
    return offsets(query_cols, key_cols).abs() <= window


def dilated_pattern(query_cols: Tensor, key_cols: Tensor, *, window: int) -> Tensor:
    return offsets(query_cols, key_cols).remainder(max(window, 1)) == 0


@functools.lru_cache(maxsize=None)
def random_distances(window: int) -> tuple[int, ...]:
    """RANDOM_KEYS distinct distances drawn uniformly from (w, w + RANDOM_SPAN] with a fixed seed."""
    generator = torch.Generator().manual_seed(RANDOM_SEED)
    draw = torch.randperm(RANDOM_SPAN, generator=generator)[:RANDOM_KEYS] + window + 1
    return tuple(sorted(draw.tolist()))


def random_pattern(query_cols: Tensor, key_cols: Tensor, *, window: int) -> Tensor:
    """Window and random distances (both directions); the global keys come from `with_global_keys`."""
    return random_pattern_cols(query_cols[:, None], key_cols[None, :], window)


def with_global_keys(pattern, mask: Tensor | None, T: int, S: int):
    """BigBird's global keys: the first GLOBAL_KEYS keys each query may see. Without a mask those are
    columns 0..G-1; with one (padding), the first G allowed columns of each row, so a left-padded row
    attends to its own first tokens. Returns (pattern, mask) for `tiled`."""
    if mask is None:
        return (lambda qc, kc: pattern(qc, kc) | (kc[None, :] < GLOBAL_KEYS)), None
    mask = mask.expand(mask.shape[0], 1, T, S)
    first = mask & (mask.long().cumsum(-1) <= GLOBAL_KEYS)  # (B, 1, T, S)
    cols = torch.arange(S, device=mask.device)
    return None, mask & (pattern(cols[S - T:], cols) | first)


def pattern_mask(pattern, T: int, S: int, mask: Tensor | None, causal: bool, device) -> Tensor:
    """The equivalent (B or 1, 1, T, S) mask of a pattern: what `naive` needs to compute the same thing."""
    cols = torch.arange(S, device=device)
    allowed = pattern(cols[S - T:], cols)[None, None]  # (1, 1, T, S)
    if mask is not None:
        return mask & allowed
    if causal:
        return allowed & (offsets(cols[S - T:], cols) >= 0)
    return allowed


# ---------------------------------------------------------------------------------------- local (banded)


def band(T: int, S: int, window: int, device, reach: int | None = None) -> tuple[Tensor, Tensor, Tensor, int]:
    """Query blocks of b = min(w, T) rows and the key columns each block may reach, `reach` (default w) on
    either side: (nb, b) query rows, (nb, b + 2 reach) key columns (out-of-range ones clamped, flagged by
    `valid`)."""
    reach = window if reach is None else reach
    b = block_size(T, window)
    nb = math.ceil(T / b)
    rows = torch.arange(nb * b, device=device).view(nb, b)  # (nb, b) query rows, some past T (padding)
    start = (S - T) + rows[:, :1] - reach  # (nb, 1) the first key column of each block's band
    cols = start + torch.arange(b + 2 * reach, device=device)  # (nb, W)
    valid = (cols >= 0) & (cols < S)
    return rows, cols, valid, b


def local(q: Tensor, k: Tensor, v: Tensor, *, mask: Tensor | None, causal: bool, bias: Tensor | None,
          scale: float, dropout: float = 0.0, value_bias: RelativeValues | None = None, window: int) -> Tensor:
    """softmax over the keys with |i - j| <= w, per query block of b = w rows against its W = b + 2w band
    (note 000 §15.1.1): (B, H, T/b, b, W) scores, O(T w) time and memory."""
    B, H, T, Dh = q.shape
    S = k.shape[-2]
    rows, cols, valid, b = band(T, S, window, q.device)
    nb, W = cols.shape
    r, c = rows.clamp(max=T - 1)[:, :, None], cols.clamp(0, S - 1)[:, None, :]  # (nb, b, 1), (nb, 1, W)
    q_blocks = q[:, :, rows.clamp(max=T - 1)]  # (B, H, nb, b, Dh)
    k_band, v_band = k[:, :, cols.clamp(0, S - 1)], v[:, :, cols.clamp(0, S - 1)]  # (B, H, nb, W, Dh)
    scores = (q_blocks @ k_band.transpose(-2, -1)).to(torch.promote_types(q.dtype, torch.float32)) * scale
    if bias is not None:
        scores = scores + bias.expand(*bias.shape[:-2], T, S)[..., r, c]  # (B, H, nb, b, W)
    i = (S - T) + rows[:, :, None]  # (nb, b, 1) query columns
    allowed = valid[:, None, :] & ((i - cols[:, None, :]).abs() <= window)  # (nb, b, W)
    if mask is not None:
        allowed = allowed & mask.expand(mask.shape[0], 1, T, S)[:, :, r, c]  # (B, 1, nb, b, W)
    elif causal:
        allowed = allowed & (cols[:, None, :] <= i)
    allowed = allowed | (rows >= T)[:, :, None]  # padding rows see anything: finite, then dropped
    weights = scores.masked_fill(~allowed, float("-inf")).softmax(-1)  # (B, H, nb, b, W)
    if value_bias is not None:
        value_bias = RelativeValues(value_bias.index[:, r, c], value_bias.table)  # index (B, nb, b, W)
    out = weighted_values(weights, v_band, value_bias, dropout)  # (B, H, nb, b, Dh)
    return out.flatten(2, 3)[:, :, :T]  # (B, H, T, Dh)


# ---------------------------------------------------------------------------------------- dilated, random


def dilated(q: Tensor, k: Tensor, v: Tensor, *, mask: Tensor | None, causal: bool, bias: Tensor | None,
            scale: float, dropout: float = 0.0, value_bias: RelativeValues | None = None, window: int) -> Tensor:
    """(i - j) mod d = 0 holds exactly when columns i and j are in the same residue class mod d, so each
    class attends densely within itself (tiled): sum_r T_r S_r ~ T S / d scores instead of T S, O(n) memory.
    The queries of a class are the last of its key columns, so the causal triangle stays bottom-right."""
    d = max(window, 1)
    T, S = q.shape[-2], k.shape[-2]
    if T == S and S % d == 0 and mask is None and bias is None and value_bias is None:
        return classes_as_heads(q, k, v, d, causal=causal, scale=scale, dropout=dropout)
    query_cols = torch.arange(S - T, S, device=q.device)
    outs, order = [], []
    for r in range(min(d, S)):
        rows = torch.nonzero(query_cols.remainder(d) == r).flatten()  # (T_r,) this class's queries
        if rows.numel() == 0:
            continue
        cols = torch.arange(r, S, d, device=q.device)  # (S_r,) and keys
        outs.append(tiled(q[:, :, rows], k[:, :, cols], v[:, :, cols], mask=class_of(mask, T, S, rows, cols),
                          causal=causal, bias=class_of(bias, T, S, rows, cols), scale=scale, dropout=dropout,
                          value_bias=None if value_bias is None else
                          RelativeValues(value_bias.index[:, rows][:, :, cols], value_bias.table)))
        order.append(rows)
    inverse = torch.argsort(torch.cat(order))  # each query's place among the classes' outputs
    return torch.cat(outs, dim=2)[:, :, inverse]  # (B, H, T, Dh)


def classes_as_heads(q: Tensor, k: Tensor, v: Tensor, d: int, *, causal: bool, scale: float,
                     dropout: float) -> Tensor:
    """The d residue classes of n = S columns, all of size n / d, as d times the heads of one tiled call:
    column a d + r is entry a of class r. (B, H, n, Dh) -> (B, H d, n / d, Dh) and back."""
    B, H, n, _ = q.shape

    def split(x: Tensor) -> Tensor:
        return x.unflatten(2, (n // d, d)).transpose(2, 3).flatten(1, 2)  # (B, H d, n / d, Dh)

    out = tiled(split(q), split(k), split(v), mask=None, causal=causal, bias=None, scale=scale, dropout=dropout)
    return out.unflatten(1, (H, d)).transpose(2, 3).flatten(2, 3)  # (B, H, n, Dh)


def class_of(x: Tensor | None, T: int, S: int, rows: Tensor, cols: Tensor) -> Tensor | None:
    """The (rows, cols) entries of a tensor broadcastable to (.., T, S) (a mask or a score bias)."""
    return None if x is None else x.expand(*x.shape[:-2], T, S)[..., rows, :][..., cols]


def random(q: Tensor, k: Tensor, v: Tensor, *, mask: Tensor | None, causal: bool, bias: Tensor | None,
           scale: float, dropout: float = 0.0, value_bias: RelativeValues | None = None, window: int) -> Tensor:
    """Without a padding mask: the window and the random distances lie within w + RANDOM_SPAN of the query,
    so each block of queries scores its band of that reach plus the GLOBAL_KEYS first columns: O(n (w +
    RANDOM_SPAN)). With one, each row's global keys are its own first allowed columns: the tiled sweep."""
    if mask is None:
        return banded_random(q, k, v, causal=causal, bias=bias, scale=scale, dropout=dropout,
                             value_bias=value_bias, window=window)
    pattern, mask = with_global_keys(functools.partial(random_pattern, window=window), mask,
                                     q.shape[-2], k.shape[-2])
    return tiled(q, k, v, mask=mask, causal=causal, bias=bias, scale=scale, dropout=dropout,
                 value_bias=value_bias, pattern=pattern)


def banded_random(q: Tensor, k: Tensor, v: Tensor, *, causal: bool, bias: Tensor | None, scale: float,
                  dropout: float, value_bias: RelativeValues | None, window: int) -> Tensor:
    """Per query block: its band (reach w + RANDOM_SPAN) with the pattern, and the global columns 0..G-1
    (left out of the band, so no key counts twice), under one softmax. (B, H, T, Dh)"""
    T, S = q.shape[-2], k.shape[-2]
    rows, cols, valid, b = band(T, S, window, q.device, reach=window + RANDOM_SPAN)
    glob = torch.arange(min(GLOBAL_KEYS, S), device=q.device)  # (G,)
    nb = rows.shape[0]
    keys = torch.cat((cols, glob.expand(nb, -1)), dim=1)  # (nb, W + G) every block's key columns
    r, c = rows.clamp(max=T - 1)[:, :, None], keys.clamp(0, S - 1)[:, None, :]  # (nb, b, 1), (nb, 1, W + G)
    i = (S - T) + rows[:, :, None]  # (nb, b, 1) query columns
    in_band = valid[:, None, :] & random_pattern_cols(i, cols[:, None, :], window) & (cols[:, None, :] >= len(glob))
    allowed = torch.cat((in_band, torch.ones_like(in_band[..., :len(glob)])), dim=-1)  # (nb, b, W + G)
    if causal:
        allowed = allowed & (keys[:, None, :] <= i)
    allowed = allowed | (rows >= T)[:, :, None]  # padding rows see anything: finite, then dropped
    q_blocks = q[:, :, rows.clamp(max=T - 1)]  # (B, H, nb, b, Dh)
    k_keys, v_keys = k[:, :, keys.clamp(0, S - 1)], v[:, :, keys.clamp(0, S - 1)]  # (B, H, nb, W + G, Dh)
    scores = (q_blocks @ k_keys.transpose(-2, -1)).to(torch.promote_types(q.dtype, torch.float32)) * scale
    if bias is not None:
        scores = scores + bias.expand(*bias.shape[:-2], T, S)[..., r, c]  # (B, H, nb, b, W + G)
    weights = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
    if value_bias is not None:
        value_bias = RelativeValues(value_bias.index[:, r, c], value_bias.table)  # index (B, nb, b, W + G)
    out = weighted_values(weights, v_keys, value_bias, dropout)  # (B, H, nb, b, Dh)
    return out.flatten(2, 3)[:, :, :T]


def random_pattern_cols(i: Tensor, j: Tensor, window: int) -> Tensor:
    """random_pattern on broadcast columns: |i - j| <= w or |i - j| one of the random distances."""
    distance = (i - j).abs()
    chosen = torch.tensor(random_distances(window), device=distance.device)
    return (distance <= window) | torch.isin(distance, chosen)


def sparse_weights(pattern_fn, global_keys: bool = False):
    """The explicit weights of a sparse kernel: naive attention with the pattern in the mask."""
    def weights(q, k, *, mask, causal, bias, scale, window, on_scores=None):
        T, S = q.shape[-2], k.shape[-2]
        pattern = functools.partial(pattern_fn, window=window)
        if global_keys:
            pattern, mask = with_global_keys(pattern, mask, T, S)
        if pattern is not None:
            mask = pattern_mask(pattern, T, S, mask, causal, q.device)
        return attention_weights(q, k, mask=mask, causal=causal, bias=bias, scale=scale, on_scores=on_scores)
    return weights


def block_size(T: int, window: int) -> int:
    """Rows per query block of the banded kernels (local, random): b = min(w, T)."""
    return min(max(window, 1), T)


def local_width(T: int, S: int, window: int) -> int:
    """Keys each block of `local` scores: its b rows and w on either side."""
    return block_size(T, window) + 2 * window


def random_width(T: int, S: int, window: int) -> int:
    """Keys each block of `random` (no padding mask) scores: reach w + RANDOM_SPAN and the global columns."""
    return block_size(T, window) + 2 * (window + RANDOM_SPAN) + min(GLOBAL_KEYS, S)


def banded_costs(width: Callable[[int, int, int], int]):
    """(score_pairs, copied_rows) of a banded kernel whose ceil(T / b) blocks of b rows each score width(T, S, w)
    keys and keep gathered copies of their queries, keys and values (KernelSpec's cost model for qkv calc)."""
    def pairs(T: int, S: int, window: int) -> int:
        b = block_size(T, window)
        return math.ceil(T / b) * b * width(T, S, window)

    def rows(T: int, S: int, window: int) -> int:
        b = block_size(T, window)
        blocks = math.ceil(T / b)
        return blocks * b + 2 * blocks * width(T, S, window)

    return pairs, rows


def class_pairs(T: int, S: int, window: int) -> int:
    """Scores `dilated` computes: sum over the residue classes r of T_r queries x S_r keys (each class's
    tiles all computed: exact while a class fits one tile of keys, an upper bound beyond under causality)."""
    d = max(window, 1)
    keys = [len(range(r, S, d)) for r in range(d)]
    queries = [len(range(S - T + (r - (S - T)) % d, S, d)) for r in range(d)]
    return sum(t * s for t, s in zip(queries, keys))


def class_rows(T: int, S: int, window: int) -> int:
    """dilated regroups q, k and v by class before its tiled call, which saves those copies."""
    return T + 2 * S


LOCAL_PAIRS, LOCAL_ROWS = banded_costs(local_width)
RANDOM_PAIRS, RANDOM_ROWS = banded_costs(random_width)
# causal local attention reads the w keys before each query: a rolling cache of w columns serves it
KERNELS.register("local")(KernelSpec(fn=local, weights=sparse_weights(local_pattern), windowed=True,
                                     reach=lambda window: window, full=False, score_pairs=LOCAL_PAIRS,
                                     copied_rows=LOCAL_ROWS))
# dilated tiles each class with the flash kernel: out and L saved, no probabilities
KERNELS.register("dilated")(KernelSpec(fn=dilated, weights=sparse_weights(dilated_pattern), windowed=True,
                                       full=False, keeps_probabilities=False, score_pairs=class_pairs,
                                       copied_rows=class_rows))
KERNELS.register("random")(KernelSpec(fn=random, weights=sparse_weights(random_pattern, global_keys=True),
                                      windowed=True, full=False, score_pairs=RANDOM_PAIRS, copied_rows=RANDOM_ROWS))
