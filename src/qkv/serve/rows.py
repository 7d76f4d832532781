"""A batch cache gathered from rows of others: each row's columns right-aligned, padding before (the layout
of qkv.serve.engine's docstring, as qkv.generate.pad_left lays out prompts)."""
from __future__ import annotations

from torch import nn

from qkv.nn.cache import KVCache


def gather_rows(model: nn.Module, parts: list[tuple[KVCache, int, int]], room: int) -> KVCache:
    """A new cache with one row per (cache, row, n): that row's last n columns, right-aligned, padding before,
    and `room` free columns after for the steps to come."""
    length = max(n for _, _, n in parts)
    out = model.new_cache(len(parts), length + room)
    out.padding.zero_()  # every column is padding until a row's tokens are copied in
    for b, (cache, row, n) in enumerate(parts):
        start, end = cache.length - n, cache.length  # the row's columns in its cache
        for mine, theirs in zip(out.layers, cache.layers):
            mine.k[b, :, :length - n] = 0  # padding columns: read (with weight 0), so never left unwritten
            mine.v[b, :, :length - n] = 0
            mine.k[b, :, length - n:length] = theirs.k[row, :, start:end]
            mine.v[b, :, length - n:length] = theirs.v[row, :, start:end]
        out.positions[b, length - n:length] = cache.positions[row, start:end]
        out.padding[b, length - n:length] = cache.padding[row, start:end]
        out.next_position[b], out.last_token[b] = cache.next_position[row], cache.last_token[row]
    for layer in out.layers:
        layer.length = length
    out.length = length
    out.padded = not bool(out.padding[:, :length].all())
    return out
