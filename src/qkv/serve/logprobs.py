"""A chosen token's log-probability and its alternatives, and a prompt's own (echo): what the API's logprobs
fields carry."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor


@dataclass(frozen=True)
class Choice:
    """One token chosen for one request: its id, log-probability and the top alternatives (if asked)."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


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
