"""The engine's helpers outside its loop: a batch cache gathered from rows of others (the rows' columns right-
aligned, padding before: qkv.serve.engine's docstring), and a choice's log-probabilities."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from qkv.nn.cache import KVCache


@dataclass(frozen=True)
class Choice:
    """One token chosen for one request: its id, log-probability and the top alternatives (if asked)."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


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


def choice_of(logits: Tensor, token: int, top: int | None) -> Choice:
    """The model's log-probability of `token` under (V,) logits (temperature 1, before any sampling setting),
    with the `top` most likely tokens; logprob NaN when not asked (top None)."""
    if top is None:
        return Choice(token, float("nan"))
    logprobs = F.log_softmax(logits.float(), dim=-1)  # (V,)
    best = torch.topk(logprobs, min(top, logprobs.numel())) if top else None
    alternatives = () if best is None else tuple(zip(best.indices.tolist(), best.values.tolist()))
    return Choice(token, float(logprobs[token]), alternatives)


def prompt_logprobs(logits: Tensor, prompt: list[int], top: int) -> list[Choice]:
    """(T, V) logits of the prompt -> a Choice for prompt tokens 1..T-1 (each given the ones before it)."""
    logprobs = F.log_softmax(logits.float(), dim=-1)  # (T, V): row t predicts token t + 1
    targets = torch.tensor(prompt[1:], dtype=torch.long, device=logits.device)
    chosen = logprobs[:-1].gather(-1, targets[:, None])[:, 0].tolist()
    if not top:
        return [Choice(t, lp) for t, lp in zip(prompt[1:], chosen)]
    best = torch.topk(logprobs[:-1], min(top, logprobs.shape[-1]), dim=-1)
    return [Choice(t, lp, tuple(zip(ids, lps))) for t, lp, ids, lps
            in zip(prompt[1:], chosen, best.indices.tolist(), best.values.tolist())]
