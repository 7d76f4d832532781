"""Preallocated key/value cache for incremental decoding.

Each attention layer owns a `LayerCache` of (B, Hkv, max_len, Dh) keys and values; the `KVCache`
also keeps, per column, the position and the padding flag of the token stored there, so left-padded
batches decode with per-row positions.

The cache is also Transformer-XL's segment memory (qkv.nn.relative.TransformerXL): the next segment runs
with the cache the previous one filled; `detach()` is the paper's stop-gradient and `keep_last(M)` keeps
a memory of M columns.

Rolling cache (`window=w > 0`): a kernel whose query at column i reads only keys j >= i - w (the local
kernel, |i - j| <= w, causal) never needs more than the last w columns of earlier calls. `RollingLayerCache`
and a KVCache built with `window` keep exactly those between calls (a call sees w + T columns), so memory
stays O(w) however long generation runs, and `max_len` no longer bounds the length. `rolling_window(name,
window)` says which kernels allow it (KernelSpec.reach); the models' `new_cache(..., rolling=True)` asks
it (generation does; Transformer-XL segment training keeps the full cache).

Ring cache (a sliding layer of qkv.plan, `layer_windows`): a layer that sees only its last W keys keeps
W + RING_SPARE columns in a ring, column c in slot c mod slots, so a long chat's memory grows with the global
layers only (Gemma 3 270M at 8,192 tokens: 3 of its 18 layers). The ring has its W + RING_SPARE slots however
short the context, so that every cache a model decodes with is of one kind: the compiled step traces one graph
for it (qkv.generate.compiled; a cache of another kind would trace again, a minute or more, in the middle of a
chat or a server's batch). The KVCache still records every column's position and padding (a few bytes a
column); a ring's `append` returns its kept columns in order, then this
call's, with `columns` their indices among all of them, and the attention masks by those (qkv.nn.attention).
The spare columns let a compiled prompt of up to RING_SPARE + 1 tokens write in place without overwriting a key
one of its own queries still sees (qkv.generate.compiled).

The keys and values are allocated, not zeroed: a column is read only after it is written (append returns
the first `length` columns; a batch gathered with left padding zeroes its padding columns), so the memory a
long context reserves becomes resident only as tokens fill it (`qkv chat` reserves the model's whole
context: SmolLM2's 8,192 columns are 0.38 GB of fp32 keys and values).
"""
from __future__ import annotations

import torch
from torch import Tensor

from qkv.nn.kernels import KERNELS
from qkv.plan import RING_SPARE


def unwritten(shape: tuple[int, ...], *, dtype, device) -> Tensor:
    """Storage for columns not yet written (never read before they are; tests fill it with NaN to show it)."""
    return torch.empty(shape, dtype=dtype, device=device)


class LayerCache:
    def __init__(self, batch: int, n_kv_heads: int, max_len: int, head_dim: int, *, dtype, device,
                 v_dim: int | None = None):
        """`v_dim`: the values' width where it is not the keys' (0: none kept, latent attention's: qkv.nn.mla)."""
        shape = (batch, n_kv_heads, max_len, head_dim)
        self.k = unwritten(shape, dtype=dtype, device=device)  # (B, Hkv, max_len, Dh)
        self.v = unwritten(shape[:-1] + (head_dim if v_dim is None else v_dim,), dtype=dtype, device=device)
        self.length = 0

    def append(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Store this call's (B, Hkv, T, Dh) keys and values; return all so far, (B, Hkv, S, Dh)."""
        end = self.length + k.shape[2]
        if end > self.k.shape[2]:
            raise ValueError(f"KV cache overflow: {end} > {self.k.shape[2]} positions")
        self.k[:, :, self.length:end] = k
        self.v[:, :, self.length:end] = v
        self.length = end
        return self.k[:, :, :end], self.v[:, :, :end]

    def reorder(self, rows: Tensor) -> None:
        """Keep rows `rows` of the batch (beam search)."""
        self.k, self.v = self.k[rows], self.v[rows]

    def detach(self) -> None:
        """Cut the autograd history of the stored keys and values (Transformer-XL's SG(.))."""
        self.k, self.v = self.k.detach(), self.v.detach()

    def keep_last(self, n: int) -> None:
        """Keep the last n stored columns, moved to the front."""
        start = max(self.length - n, 0)
        self.k, self.v = self.k.roll(-start, dims=2), self.v.roll(-start, dims=2)  # columns start.. first
        self.length -= start


class RollingLayerCache:
    """A LayerCache that keeps only the last `window` columns between calls: (B, Hkv, <= window, Dh)."""

    def __init__(self, batch: int, n_kv_heads: int, window: int, head_dim: int, *, dtype, device):
        self.window = window
        self.k = torch.zeros(batch, n_kv_heads, 0, head_dim, dtype=dtype, device=device)  # (B, Hkv, kept, Dh)
        self.v = torch.zeros_like(self.k)
        self.length = 0

    def append(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Return the kept columns and this call's (B, Hkv, kept + T, Dh); keep the last `window` of them."""
        k, v = torch.cat((self.k, k.to(self.k.dtype)), dim=2), torch.cat((self.v, v.to(self.v.dtype)), dim=2)
        self.k, self.v = k[:, :, -self.window:], v[:, :, -self.window:]
        self.length = self.k.shape[2]
        return k, v

    reorder, detach = LayerCache.reorder, LayerCache.detach

    def keep_last(self, n: int) -> None:
        start = max(self.length - n, 0)
        self.k, self.v = self.k[:, :, start:], self.v[:, :, start:]
        self.length = self.k.shape[2]


class RingLayerCache:
    """A sliding layer's keys and values: the last `slots` columns, column c in slot c mod slots (B, Hkv, slots, Dh).
    Zeroed: a slot the compiled step reads before it is written is masked (weight 0, which NaN would turn into
    NaN)."""

    def __init__(self, batch: int, n_kv_heads: int, slots: int, head_dim: int, *, dtype, device):
        self.slots = slots
        self.k = torch.zeros(batch, n_kv_heads, slots, head_dim, dtype=dtype, device=device)
        self.v = torch.zeros_like(self.k)
        self.length = 0  # columns written so far, all of them (the ring holds the last `slots`)
        self.columns: Tensor | None = None  # the columns of what the last append returned (S',)

    def append(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """The kept columns in order, then this call's: (B, Hkv, kept + T, Dh); the last `slots` are kept."""
        T, start = k.shape[2], self.length
        kept = min(start, self.slots)
        old = torch.arange(start - kept, start, device=k.device)
        seen_k = torch.cat((self.k[:, :, old % self.slots], k.to(self.k.dtype)), dim=2)
        seen_v = torch.cat((self.v[:, :, old % self.slots], v.to(self.v.dtype)), dim=2)
        written = min(T, self.slots)
        new = torch.arange(start + T - written, start + T, device=k.device)
        self.k[:, :, new % self.slots] = k[:, :, T - written:].to(self.k.dtype)
        self.v[:, :, new % self.slots] = v[:, :, T - written:].to(self.v.dtype)
        self.length = start + T
        self.columns = torch.arange(start - kept, start + T, device=k.device)
        return seen_k, seen_v

    def reorder(self, rows: Tensor) -> None:
        self.k, self.v = self.k[rows], self.v[rows]

    detach = LayerCache.detach

    def keep_last(self, n: int) -> None:
        """Keep the last n columns, numbered from 0 again: the slots turned so that column c - start, once c,
        sits in slot (c - start) mod slots (those of the n it no longer holds were overwritten before)."""
        start = max(self.length - n, 0)
        self.k, self.v = self.k.roll(-(start % self.slots), dims=2), self.v.roll(-(start % self.slots), dims=2)
        self.length -= start

    def holds(self, n: int, window: int) -> bool:
        """Whether, cut back to n columns, the ring still holds the last `window` - 1 of them (a query at
        column n sees back to n - window + 1)."""
        return self.length <= self.slots or n - window + 1 >= self.length - self.slots


def rolling_window(kernel: str, window: int) -> int:
    """How many past columns a cache must keep for `kernel` (0: all of them, no rolling): its spec's reach."""
    reach = KERNELS.get(kernel).reach
    return reach(window) if reach is not None and window > 0 else 0


class KVCache:
    def __init__(self, n_layers: int, batch: int, n_kv_heads: int, max_len: int, head_dim: int,
                 *, dtype=torch.float32, device=None, window: int = 0, layer_windows: tuple[int, ...] = (),
                 v_dim: int | None = None):
        """`window` > 0: a rolling cache (module docstring): only the last `window` columns are kept.
        `layer_windows`: each layer's sliding window W (0: global), a ring of W + RING_SPARE slots where W > 0."""
        self.window = window
        self.layer_windows = tuple(layer_windows) or (0,) * n_layers
        if window:
            self.layers = [RollingLayerCache(batch, n_kv_heads, window, head_dim, dtype=dtype, device=device)
                           for _ in range(n_layers)]
        else:
            self.layers = [RingLayerCache(batch, n_kv_heads, w + RING_SPARE, head_dim, dtype=dtype, device=device)
                           if w else
                           LayerCache(batch, n_kv_heads, max_len, head_dim, dtype=dtype, device=device, v_dim=v_dim)
                           for w in self.layer_windows]
        self.max_len = max_len
        self.length = 0
        columns = 0 if window else max_len  # rolling: the kept columns only, grown by extend
        self.next_position = torch.zeros(batch, dtype=torch.long, device=device)  # (B,)
        self.positions = torch.zeros(batch, columns, dtype=torch.long, device=device)  # (B, max_len)
        self.padding = torch.ones(batch, columns, dtype=torch.bool, device=device)  # True = real token
        self.padded = False
        self.last_token = torch.full((batch,), -1, dtype=torch.long, device=device)  # (B,) -1 = none yet

    def extend(self, positions: Tensor, key_padding: Tensor | None) -> tuple[Tensor, Tensor | None]:
        """Record the new columns' positions and padding; return all columns' (B, S) of both."""
        T = positions.shape[1]
        if key_padding is not None:
            self.padded = self.padded or not bool(key_padding.all())
        padding = torch.ones_like(positions, dtype=torch.bool) if key_padding is None else key_padding.bool()
        if self.window:
            return self.roll(positions, padding)
        end = self.length + T
        if end > self.max_len:
            raise ValueError(f"KV cache overflow: {end} > {self.max_len} positions")
        self.positions[:, self.length:end] = positions
        self.padding[:, self.length:end] = padding
        self.length = end
        return self.positions[:, :end], (self.padding[:, :end] if self.padded else None)

    def roll(self, positions: Tensor, padding: Tensor) -> tuple[Tensor, Tensor | None]:
        """The rolling form of `extend`: all columns of this call, then keep the last `window`. (B, kept + T)"""
        positions, padding = torch.cat((self.positions, positions), 1), torch.cat((self.padding, padding), 1)
        self.positions, self.padding = positions[:, -self.window:], padding[:, -self.window:]
        self.length = self.positions.shape[1]
        return positions, (padding if self.padded else None)

    def open_column(self) -> Tensor:
        """Claim the next column of an unpadded, non-rolling cache for one new token per row, as a forward of
        one token would (its position recorded, every layer's length advanced); the caller writes the column's
        keys and values (qkv.generate.compiled). Returns the new tokens' (B,) positions."""
        positions = self.next_position  # (B,)
        self.extend(positions[:, None], None)
        self.next_position = positions + 1
        for layer in self.layers:
            layer.length = self.length
        return positions

    def open_columns(self, count: int) -> Tensor:
        """open_column for `count` new tokens per row (a short prompt's compiled prefill): their (B, count)
        positions."""
        positions = self.next_position[:, None] + torch.arange(count, device=self.next_position.device)
        self.extend(positions, None)
        self.next_position = positions[:, -1] + 1
        for layer in self.layers:
            layer.length = self.length
        return positions

    def detach(self) -> None:
        """Stop gradients at the cached keys/values: call between Transformer-XL training segments."""
        for layer in self.layers:
            layer.detach()

    def keep_last(self, n: int) -> None:
        """Keep the last n columns (keys, values, positions, padding) as the memory of the next call."""
        start = max(self.length - n, 0)
        for layer in self.layers:
            layer.keep_last(n)
        if self.window:
            self.positions, self.padding = self.positions[:, start:], self.padding[:, start:]
        else:
            self.positions, self.padding = self.positions.roll(-start, dims=1), self.padding.roll(-start, dims=1)
        self.length -= start

    def can_truncate(self, n: int) -> bool:
        """Whether truncate(n) applies: an unpadded, non-rolling cache, n columns it holds (every ring still
        holding the window a query at column n sees)."""
        rings_hold = all(layer.holds(n, w) for layer, w in zip(self.layers, self.layer_windows)
                         if isinstance(layer, RingLayerCache))
        return not self.window and not self.padded and 0 <= n <= self.length and rings_hold

    def truncate(self, n: int, last_token: int | None = None) -> None:
        """Forget every column after the first n of an unpadded cache (a chat whose next prompt shares only
        its first n tokens with what was fed): the next call continues at position n. `last_token`: the
        token at n - 1 (the hashed bigram embedding's previous token)."""
        if not self.can_truncate(n):
            raise ValueError("only an unpadded, non-rolling cache can be cut back, and to a length it holds")
        for layer in self.layers:
            layer.length = n
        self.length = n
        self.next_position.fill_(n)
        self.last_token.fill_(-1 if last_token is None else last_token)

    def reorder(self, rows: Tensor) -> None:
        for layer in self.layers:
            layer.reorder(rows)
        self.next_position, self.last_token = self.next_position[rows], self.last_token[rows]
        self.positions, self.padding = self.positions[rows], self.padding[rows]
