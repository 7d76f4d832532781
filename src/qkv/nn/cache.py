"""Preallocated key/value cache for incremental decoding.

Each attention layer owns a `LayerCache` of (B, Hkv, max_len, Dh) keys and values; the `KVCache`
also keeps, per column, the position and the padding flag of the token stored there, so left-padded
batches decode with per-row positions.

The cache is also Transformer-XL's segment memory (qkv.nn.relative.TransformerXL): the next segment runs
with the cache the previous one filled; `detach()` is the paper's stop-gradient and `keep_last(M)` keeps
a memory of M columns. The cache holds every column until then: a sliding-window kernel (local) reads
only the last w + 1 columns, but a rolling cache that drops the rest on its own is not built yet.
"""
from __future__ import annotations

import torch
from torch import Tensor


class LayerCache:
    def __init__(self, batch: int, n_kv_heads: int, max_len: int, head_dim: int, *, dtype, device):
        shape = (batch, n_kv_heads, max_len, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)  # (B, Hkv, max_len, Dh)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
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


class KVCache:
    def __init__(self, n_layers: int, batch: int, n_kv_heads: int, max_len: int, head_dim: int,
                 *, dtype=torch.float32, device=None):
        self.layers = [LayerCache(batch, n_kv_heads, max_len, head_dim, dtype=dtype, device=device)
                       for _ in range(n_layers)]
        self.max_len = max_len
        self.length = 0
        self.next_position = torch.zeros(batch, dtype=torch.long, device=device)  # (B,)
        self.positions = torch.zeros(batch, max_len, dtype=torch.long, device=device)  # (B, max_len)
        self.padding = torch.ones(batch, max_len, dtype=torch.bool, device=device)  # True = real token
        self.padded = False

    def extend(self, positions: Tensor, key_padding: Tensor | None) -> tuple[Tensor, Tensor | None]:
        """Record the new columns' positions and padding; return all columns' (B, S) of both."""
        T = positions.shape[1]
        end = self.length + T
        if end > self.max_len:
            raise ValueError(f"KV cache overflow: {end} > {self.max_len} positions")
        self.positions[:, self.length:end] = positions
        if key_padding is not None:
            self.padding[:, self.length:end] = key_padding.bool()
            self.padded = self.padded or not bool(key_padding.all())
        self.length = end
        return self.positions[:, :end], (self.padding[:, :end] if self.padded else None)

    def detach(self) -> None:
        """Stop gradients at the cached keys/values: call between Transformer-XL training segments."""
        for layer in self.layers:
            layer.detach()

    def keep_last(self, n: int) -> None:
        """Keep the last n columns (keys, values, positions, padding) as the memory of the next call."""
        start = max(self.length - n, 0)
        for layer in self.layers:
            layer.keep_last(n)
        self.positions, self.padding = self.positions.roll(-start, dims=1), self.padding.roll(-start, dims=1)
        self.length -= start

    def reorder(self, rows: Tensor) -> None:
        for layer in self.layers:
            layer.reorder(rows)
        self.next_position = self.next_position[rows]
        self.positions, self.padding = self.positions[rows], self.padding[rows]
