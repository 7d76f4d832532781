"""Logit processors and choice rules: how the next token is picked from a (B, V) row of logits.

A logit processor has one signature, `(logits (B, V) float32, state) -> logits (B, V)`, reads its
parameter from `state.params` and is the identity at its neutral value (temperature 1, top-k >= V,
top-p 1, min-p 0, penalty 1). Removed tokens get logit -inf, so processors compose in any order and
softmax gives them probability 0. A strategy is a processor chain plus a choice rule:

    greedy: repetition_penalty                                       -> argmax
    sample: repetition_penalty, temperature, min_p                   -> draw from softmax
    top-k:  repetition_penalty, temperature, top_k, min_p            -> draw
    top-p:  repetition_penalty, temperature, top_p, min_p            -> draw
    top-k-top-p: repetition_penalty, temperature, top_k, top_p, min_p -> draw  (both filters, as transformers)
    beam:   repetition_penalty, then log-softmax (decode.beam_search does the choosing)

Ties are broken by the lower token index everywhere: argmax returns the first maximum; top-k and
top-p rank tokens with a stable descending sort, so among equal logits the lower index ranks first
and is the one kept when a tie straddles the boundary. min-p needs no tie rule (it thresholds).
The order of top-k / top-p and min-p does not matter: min-p compares p_i / p_max, which
renormalising over the kept tokens leaves unchanged.

Sampling draws with an explicit torch.Generator, so a seed reproduces a run exactly.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

from qkv.errors import QkvError
from qkv.registry import Registry


@dataclass(frozen=True, kw_only=True)
class SamplingParams:
    temperature: float = 1.0  # tau > 0: logits / tau
    top_k: int = 50  # keep exactly the k highest-logit tokens
    top_p: float = 0.9  # keep the smallest highest-probability set with total >= p
    min_p: float = 0.0  # keep tokens with p_i >= min_p * max_j p_j
    repetition_penalty: float = 1.0  # CTRL (Keskar et al. 2019): > 1 discourages seen tokens

    def validate(self) -> "SamplingParams":
        checks = (("temperature", self.temperature > 0, "> 0"), ("top_k", self.top_k >= 1, ">= 1"),
                  ("top_p", 0 < self.top_p <= 1, "in (0, 1]"), ("min_p", 0 <= self.min_p <= 1, "in [0, 1]"),
                  ("repetition_penalty", self.repetition_penalty > 0, "> 0"))
        for name, ok, allowed in checks:
            if not ok:
                raise QkvError(f"{name}={getattr(self, name)} must be {allowed}")
        return self


@dataclass
class SamplingState:
    """What a processor may read at one step."""

    params: SamplingParams
    tokens: Tensor  # (B, T) every token so far: prompt (padding included) + generated
    token_mask: Tensor | None = None  # (B, T) 1 for real tokens, 0 for padding; None = all real


Processor = Callable[[Tensor, SamplingState], Tensor]
PROCESSORS: Registry[Processor] = Registry("logit processor")


@PROCESSORS.register("temperature")
def temperature(logits: Tensor, state: SamplingState) -> Tensor:
    """softmax(z / tau): tau < 1 sharpens, tau > 1 flattens."""
    tau = state.params.temperature
    return logits if tau == 1.0 else logits / tau


def rank_descending(logits: Tensor) -> Tensor:
    """Token ids by decreasing logit, equal logits in increasing id order. (B, V)"""
    return torch.sort(logits, dim=-1, descending=True, stable=True).indices


def keep_ranked(logits: Tensor, order: Tensor, keep_sorted: Tensor) -> Tensor:
    """Set to -inf every token whose rank (position in `order`) is not kept by `keep_sorted` (B, V)."""
    keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)  # back to token order
    return logits.masked_fill(~keep, float("-inf"))


@PROCESSORS.register("top_k")
def top_k(logits: Tensor, state: SamplingState) -> Tensor:
    """Keep exactly the k highest logits (Fan et al. 2018); ties go to the lower token id."""
    k = state.params.top_k
    if k >= logits.shape[-1]:
        return logits
    order = rank_descending(logits)  # (B, V)
    ranks = torch.arange(logits.shape[-1], device=logits.device).expand_as(order)
    return keep_ranked(logits, order, ranks < k)


@PROCESSORS.register("top_p")
def top_p(logits: Tensor, state: SamplingState) -> Tensor:
    """Nucleus (Holtzman et al. 2020): the smallest top-ranked set whose probability reaches p.

    A token is kept when the probability ranked strictly above it is still < p, so the first token
    is always kept and the set is never empty.
    """
    p = state.params.top_p
    if p >= 1.0:
        return logits
    order = rank_descending(logits)  # (B, V)
    probs = logits.float().softmax(-1).gather(-1, order)  # (B, V) in rank order
    before = probs.cumsum(-1) - probs  # probability ranked strictly above each token
    return keep_ranked(logits, order, before < p)


@PROCESSORS.register("min_p")
def min_p(logits: Tensor, state: SamplingState) -> Tensor:
    """Keep tokens with p_i >= min_p * p_max (Nguyen et al. 2024), i.e. z_i >= z_max + log(min_p)."""
    ratio = state.params.min_p
    if ratio <= 0.0:
        return logits
    probs = logits.float().softmax(-1)  # (B, V)
    threshold = ratio * probs.max(dim=-1, keepdim=True).values  # (B, 1)
    return logits.masked_fill(probs < threshold, float("-inf"))


def seen_tokens(state: SamplingState, vocab: int) -> Tensor:
    """(B, V) bool: which tokens occur in the real (unpadded) tokens so far."""
    tokens = state.tokens
    if state.token_mask is not None:  # send padding to an extra column that is dropped
        tokens = tokens.masked_fill(state.token_mask == 0, vocab)
    seen = torch.zeros(tokens.shape[0], vocab + 1, dtype=torch.bool, device=tokens.device)
    return seen.scatter_(-1, tokens, True)[:, :vocab]


@PROCESSORS.register("repetition_penalty")
def repetition_penalty(logits: Tensor, state: SamplingState) -> Tensor:
    """CTRL (Keskar et al. 2019, eq. 2, as Hugging Face applies it): for every token already in the
    prompt or generated, z / penalty where z > 0 and z * penalty where z <= 0."""
    penalty = state.params.repetition_penalty
    if penalty == 1.0:
        return logits
    penalised = torch.where(logits > 0, logits / penalty, logits * penalty)
    return torch.where(seen_tokens(state, logits.shape[-1]), penalised, logits)


def process(logits: Tensor, state: SamplingState, names: tuple[str, ...]) -> Tensor:
    """Apply the named processors in order to (B, V) logits, computed in fp32."""
    logits = logits.float()  # (B, V); sampling arithmetic in fp32 whatever the model's dtype
    for name in names:
        logits = PROCESSORS.get(name)(logits, state)
    return logits


Choice = Callable[[Tensor, "torch.Generator | None"], Tensor]


ARGMAX_BLOCK = 1024  # a long row's argmax by blocks of this many logits (argmax below)


def argmax(logits: Tensor, generator: torch.Generator | None = None) -> Tensor:
    """(B, V) -> (B,) the highest logit, the first maximum (lowest id) where several are equal, a NaN before any
    number (as torch.argmax). torch's argmax over one long row is neither vectorized nor shared among threads
    (Gemma 3's 262,144 logits: 0.65 ms, 2026-12-07, the AVX2-only EPYC; its amax 0.03): a row of whole blocks
    takes the first block holding the maximum (amax, NaN-propagating, then argmax over the blocks) and the
    first maximum within it, 0.05 ms."""
    B, V = logits.shape
    if V % ARGMAX_BLOCK or V < 8 * ARGMAX_BLOCK:
        return logits.argmax(dim=-1)
    blocks = logits.view(B, V // ARGMAX_BLOCK, ARGMAX_BLOCK)
    block = blocks.amax(-1).argmax(-1)  # (B,)
    return block * ARGMAX_BLOCK + blocks[torch.arange(B, device=logits.device), block].argmax(-1)


def draw(logits: Tensor, generator: torch.Generator | None = None) -> Tensor:
    """(B, V) -> (B,) one token per row drawn from softmax(logits) with `generator`."""
    probs = logits.float().softmax(-1)  # (B, V)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


@dataclass(frozen=True)
class Strategy:
    processors: tuple[str, ...]
    choose: Choice | None  # None: the decoder chooses itself (beam search)
    samples: bool = False  # needs a random generator


STRATEGIES: Registry[Strategy] = Registry("decoding strategy")
STRATEGIES.register("greedy")(Strategy(("repetition_penalty",), argmax))
STRATEGIES.register("sample")(Strategy(("repetition_penalty", "temperature", "min_p"), draw, True))
STRATEGIES.register("top-k")(Strategy(("repetition_penalty", "temperature", "top_k", "min_p"), draw, True))
STRATEGIES.register("top-p")(Strategy(("repetition_penalty", "temperature", "top_p", "min_p"), draw, True))
STRATEGIES.register("top-k-top-p")(Strategy(("repetition_penalty", "temperature", "top_k", "top_p", "min_p"), draw,
                                           True))  # both filters, top-k first (as transformers applies them)
STRATEGIES.register("beam")(Strategy(("repetition_penalty",), None))


def make_generator(seed: int | None, device) -> torch.Generator:
    """A generator on `device`, seeded with `seed` (a fresh random seed when None)."""
    generator = torch.Generator(device=device)
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed)
    return generator
