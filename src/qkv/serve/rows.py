"""A batch cache gathered from rows of others: each row's columns right-aligned, padding before (the layout
of qkv.serve.engine's docstring, as qkv.generate.pad_left lays out prompts). A sliding layer keeps its columns
in a ring (qkv.nn.cache), the newest W + RING_SPARE of them: copied from a ring, only those it still holds."""
from __future__ import annotations

import torch
from torch import nn

from qkv.nn.cache import KVCache, LayerCache, RingLayerCache


def gather_rows(model: nn.Module, parts: list[tuple[KVCache, int, int]], room: int) -> KVCache:
    """A new cache with one row per (cache, row, n): that row's last n columns, right-aligned, padding before,
    and `room` free columns after for the steps to come."""
    length = max(n for _, _, n in parts)
    out = model.new_cache(len(parts), length + room, rings=True)
    out.padding.zero_()  # every column is padding until a row's tokens are copied in
    for b, (cache, row, n) in enumerate(parts):
        start, end = cache.length - n, cache.length  # the row's columns in its cache
        for mine, theirs in zip(out.layers, cache.layers):
            if not isinstance(mine, RingLayerCache):  # (a ring's slots start zeroed)
                mine.k[b, :, :length - n] = 0  # padding columns: read (with weight 0), so never left unwritten
                mine.v[b, :, :length - n] = 0
            copy_columns(theirs, row, start, end, mine, b, length - n, length)
        out.positions[b, length - n:length] = cache.positions[row, start:end]
        out.padding[b, length - n:length] = cache.padding[row, start:end]
        out.next_position[b], out.last_token[b] = cache.next_position[row], cache.last_token[row]
    for layer in out.layers:
        layer.length = length
    out.length = length
    out.padded = not bool(out.padding[:, :length].all())
    return out


def copy_columns(source: LayerCache | RingLayerCache, row: int, start: int, end: int,
                 target: LayerCache | RingLayerCache, b: int, at: int, length: int) -> None:
    """Columns start..end - 1 of `source`'s row into columns at.. of `target`'s row b, which will hold `length`
    columns: those a ring holds (the newest of the source's `end`, of the target's `length`)."""
    first = max(start, end - slots(source, end), start + (length - slots(target, length)) - at)
    columns = torch.arange(first, end, device=source.k.device)  # the source's columns copied
    if not len(columns):
        return
    placed = columns - start + at  # their columns in the target
    taken = columns % source.slots if isinstance(source, RingLayerCache) else columns
    put = placed % target.slots if isinstance(target, RingLayerCache) else placed
    target.k[b][:, put] = source.k[row][:, taken]
    target.v[b][:, put] = source.v[row][:, taken]


def slots(layer: LayerCache | RingLayerCache, length: int) -> int:
    """How many of the newest of `length` columns `layer` holds."""
    return layer.slots if isinstance(layer, RingLayerCache) else length
