"""Autoregressive decoding with a KV cache: greedy, sampling (plain, top-k, top-p) and beam search,
for decoder-only and encoder-decoder models.

The prompt is fed once (prefill), then one token per call; every call appends its keys and values
to a preallocated cache, so step t costs O(t) attention instead of a forward over all t tokens.
With a local kernel (window w) the cache rolls: it keeps the last w columns only (qkv.nn.cache).

One API for every family, dispatched on the `prompt` of the model's architecture (qkv.generate.families.PROMPTS):

    generate(decoder_lm, prompt_ids, ...)                          -> (B, T + new)  the prompt, then new tokens
    generate(encoder_decoder, src_ids, ..., decoder_start=BOS,
             attention_mask=src_mask)                              -> (B, 1 + new)  BOS, then new tokens

An encoder-decoder runs its encoder once and projects each layer's cross-attention K/V once; the
strategies (greedy, sampling, beam) and stop rules are the same for both families.

Batches of prompts of different lengths are LEFT-padded (`pad_left`) with an attention mask: the
last column then holds every row's newest token, positions count real tokens only (a row's
positions do not depend on its padding) and the cache remembers which columns are padding.
(An encoder-decoder's source may be padded on either side; its decoder rows all start alike.)

Context limit: prompt + new tokens never exceed `model.max_seq_len`, for every positional encoding
(learned tables have no rows beyond it; for the others it is the length the model was trained on),
except with a rolling cache and a shift-invariant encoding (qkv.generate.families: no limit there).
`max_new_tokens` is reduced to at most max_seq_len - 1 and a prompt longer than
max_seq_len - max_new_tokens keeps its last tokens; either clamp issues one `PromptTruncatedWarning`
(warnings.warn) per call. The returned ids still start with the whole `input_ids`.
"""
from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
from torch import Tensor, nn

from qkv.errors import QkvError
from qkv.generate.families import CachedDecoder, Prompt, PromptTruncatedWarning, prompt_feeder  # noqa: F401
from qkv.generate.sampling import STRATEGIES, SamplingParams, SamplingState, Strategy, make_generator, process
from qkv.nn.decoding_linear import decoding_linears

OnToken = Callable[[int, Tensor], None]
StopIf = Callable[[Tensor], Tensor]  # (B, n) new tokens so far -> (B,) bool: stop these rows now


def pad_left(sequences: Sequence[Sequence[int]], pad_id: int) -> tuple[Tensor, Tensor]:
    """Left-pad id lists to one (B, T) long tensor; mask (B, T) is 1 for tokens, 0 for padding."""
    if not sequences or any(len(seq) == 0 for seq in sequences):
        raise QkvError("pad_left needs at least one sequence and no empty sequence")
    T = max(len(seq) for seq in sequences)
    ids = torch.full((len(sequences), T), pad_id, dtype=torch.long)
    mask = torch.zeros(len(sequences), T, dtype=torch.long)
    for row, seq in enumerate(sequences):
        ids[row, T - len(seq):] = torch.as_tensor(list(seq), dtype=torch.long)
        mask[row, T - len(seq):] = 1
    return ids, mask


@contextmanager
def eval_mode(model: nn.Module):
    """Switch off dropout for the duration; restore every submodule's own mode afterwards. (A model already in
    eval mode, as loaded, is left alone: setting 400 modules' modes twice is 2 ms of a short prompt's 30.)"""
    modes = [(module, module.training) for module in model.modules()]
    if not any(training for _, training in modes):
        yield model
        return
    model.eval()
    try:
        yield model
    finally:
        for module, training in modes:
            module.training = training


def generate(model: nn.Module, input_ids: Tensor, max_new_tokens: int = 128, strategy: str = "greedy", *,
             temperature: float = 1.0, top_k: int = 50, top_p: float = 0.9, min_p: float = 0.0,
             repetition_penalty: float = 1.0, seed: int | None = None, attention_mask: Tensor | None = None,
             stop_tokens: Sequence[int] = (), num_beams: int = 4, length_penalty: float = 1.0,
             early_stopping: bool = True, on_token: OnToken | None = None, pad_id: int | None = None,
             decoder_start: int | None = None, stop_if: StopIf | None = None) -> Tensor:
    """Continue `input_ids` (B, T) (or (T,)) by up to `max_new_tokens`; returns (B, T + new) (or (T + new,)).

    An encoder-decoder model takes the source as `input_ids` (`attention_mask` its padding) and
    `decoder_start`, and returns (B, 1 + new): decoder_start, then the new tokens (qkv.generate.families).

    strategy: greedy | sample | top-k | top-p | beam (sampling.STRATEGIES). Sampling draws from a
    torch.Generator seeded with `seed` (None: a fresh random seed), one draw for all rows per step,
    so a seed reproduces a call with the same batch. A row stops at its first token
    in `stop_tokens` (kept in the output); afterwards it receives `pad_id` (default: the stop token
    it hit), and decoding ends early, with a shorter output, once every row has stopped.
    `stop_if(new (B, n))` -> (B,) bool, called after each step with every row's new tokens so far,
    stops the rows it flags as a stop token would (text.py's stop strings; not with beam search).
    `on_token(step, tokens (B,))` is called after each step (not with beam search, which only
    settles its tokens at the end). Beam search (`num_beams`, `length_penalty`, `early_stopping`)
    returns each row's best hypothesis; see `beam_search` for the n-best list.
    """
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                            repetition_penalty=repetition_penalty).validate()
    chosen = STRATEGIES.get(strategy)
    if max_new_tokens < 0:
        raise QkvError(f"max_new_tokens={max_new_tokens} must be >= 0")
    if chosen.choose is None and (on_token is not None or stop_if is not None):
        raise QkvError("on_token and stop_if act step by step; beam search settles its tokens only at the end")
    one_row = torch.as_tensor(input_ids).dim() == 1
    prompt = prompt_feeder(model)(model, input_ids, attention_mask, max_new_tokens, decoder_start)
    device = prompt.ids.device
    stop = torch.as_tensor(list(stop_tokens), dtype=torch.long, device=device)
    with torch.inference_mode(), eval_mode(model), decoding_linears(model):
        if prompt.max_new == 0:
            new = prompt.ids[:, :0]
        elif chosen.choose is None:
            beams = BeamConfig(num_beams, length_penalty, early_stopping).validate()
            best = [row[0] for row in beam_rows(prompt, beams, stop, params)]
            new = stack_hypotheses(best, pad_id, device)
        else:
            generator = make_generator(seed, device) if chosen.samples else None
            new = sample_rows(prompt, chosen, params, generator, stop, pad_id, on_token, stop_if)
    out = torch.cat([prompt.prefix, new], dim=1)  # (B, P + new)
    return out[0] if one_row else out


def sample_rows(prompt: Prompt, strategy: Strategy, params: SamplingParams, generator: torch.Generator | None,
                stop: Tensor, pad_id: int | None, on_token: OnToken | None, stop_if: StopIf | None) -> Tensor:
    """Greedy or sampled decoding of every row at once; returns the new tokens (B, n <= max_new)."""
    ids, mask, max_new = prompt.ids, prompt.mask, prompt.max_new
    B, T = ids.shape
    decoder = prompt.open(T + max_new)
    tokens = torch.cat([ids, ids.new_zeros(B, max_new)], dim=1)  # (B, T + max_new): prompt, then new
    token_mask = None if mask is None else torch.cat([mask, mask.new_ones(B, max_new)], dim=1)
    stopped = torch.zeros(B, dtype=torch.bool, device=ids.device)
    fill = torch.full((B,), -1 if pad_id is None else pad_id, dtype=torch.long, device=ids.device)
    logits = decoder.prefill(ids, mask)  # (B, V)
    for step in range(max_new):
        end = T + step
        state = SamplingState(params, tokens[:, :end], None if token_mask is None else token_mask[:, :end])
        next_tokens = strategy.choose(process(logits, state, strategy.processors), generator)  # (B,)
        stops = stop.numel() > 0 or stop_if is not None
        if stops:
            next_tokens = torch.where(stopped, fill, next_tokens)
        tokens[:, end] = next_tokens
        if stops:
            hit = ~stopped & torch.isin(next_tokens, stop)
            if stop_if is not None:
                hit |= ~stopped & stop_if(tokens[:, T:end + 1]).to(hit.device)
            fill = torch.where(hit & (fill < 0), next_tokens, fill)  # no pad_id: repeat the token it stopped at
            stopped |= hit
        if on_token is not None:
            on_token(step, next_tokens)
        if step + 1 == max_new or (stops and bool(stopped.all())):
            return tokens[:, T:end + 1]
        logits = decoder.step(next_tokens)
    return tokens[:, T:]


@dataclass(frozen=True)
class BeamConfig:
    num_beams: int
    length_penalty: float  # alpha: a hypothesis scores log p / n^alpha, n its new tokens (as HF)
    early_stopping: bool  # True: a row ends once it has num_beams finished hypotheses

    def validate(self) -> "BeamConfig":
        if self.num_beams < 1:
            raise QkvError(f"num_beams={self.num_beams} must be >= 1")
        return self


@dataclass(frozen=True)
class Hypothesis:
    tokens: Tensor  # (n,) new tokens, ending with the stop token when it stopped
    log_prob: float  # sum of the tokens' log-probabilities (after the processors)
    score: float  # log_prob / n ** length_penalty


class FinishedHypotheses:
    """The best `size` finished hypotheses of one row, best first."""

    def __init__(self, size: int, length_penalty: float):
        self.size, self.length_penalty = size, length_penalty
        self.best: list[Hypothesis] = []

    def add(self, tokens: Tensor, log_prob: float) -> None:
        score = log_prob / len(tokens) ** self.length_penalty
        if len(self.best) == self.size and score <= self.best[-1].score:
            return
        rank = sum(1 for hyp in self.best if hyp.score >= score)  # after equal scores: first found wins
        self.best.insert(rank, Hypothesis(tokens.clone(), log_prob, score))
        del self.best[self.size:]

    def is_done(self, best_running: float, length: int, max_length: int, early_stopping: bool) -> bool:
        """Can no running beam (best sum log p `best_running`, `length` tokens) still enter the list?

        early_stopping=False uses the exact bound (HF's early_stopping="never"): log p only falls as
        a beam grows, so its best reachable score is best_running / n^alpha at the n in
        (length, max_length] that maximises it: the longest for alpha > 0, the shortest otherwise.
        """
        if len(self.best) < self.size:
            return not math.isfinite(best_running)
        if early_stopping or not math.isfinite(best_running):
            return True
        n = max_length if self.length_penalty > 0 else min(length + 1, max_length)
        return self.best[-1].score >= best_running / n ** self.length_penalty


def beam_search(model: nn.Module, input_ids: Tensor, max_new_tokens: int = 128, *, num_beams: int = 4,
                length_penalty: float = 1.0, early_stopping: bool = True, stop_tokens: Sequence[int] = (),
                repetition_penalty: float = 1.0, decoder_start: int | None = None,
                attention_mask: Tensor | None = None) -> list[Hypothesis]:
    """Beam search on one prompt (T,) or (1, T) (an encoder-decoder's source, with `decoder_start`):
    up to `num_beams` hypotheses, best score first."""
    params = SamplingParams(repetition_penalty=repetition_penalty).validate()
    beams = BeamConfig(num_beams, length_penalty, early_stopping).validate()
    prompt = prompt_feeder(model)(model, input_ids, attention_mask, max_new_tokens, decoder_start)
    if prompt.ids.shape[0] != 1:
        raise QkvError(f"beam_search takes one prompt, got {prompt.ids.shape[0]}; generate(strategy='beam') "
                       "takes a batch")
    if prompt.max_new == 0:
        raise QkvError("beam_search needs max_new_tokens >= 1")
    stop = torch.as_tensor(list(stop_tokens), dtype=torch.long, device=prompt.ids.device)
    with torch.inference_mode(), eval_mode(model), decoding_linears(model):
        return beam_rows(prompt, beams, stop, params)[0]


def beam_rows(prompt: Prompt, beams: BeamConfig, stop: Tensor, params: SamplingParams) -> list[list[Hypothesis]]:
    """Beam search for every row of a (B, T) batch at once, with Hugging Face's bookkeeping.

    Each step extends each of the K live beams of a row by every token, ranks the K*V sums of
    log-probabilities (stable sort: ties to the lower beam, then token), moves stop-token
    candidates ranked in the first K to the finished list and keeps the first K others as beams.
    """
    ids, mask, max_new = prompt.ids, prompt.mask, prompt.max_new
    (B, T), K = ids.shape, beams.num_beams
    decoder = prompt.open(T + max_new)
    logits = decoder.prefill(ids, mask)  # (B, V)
    V = logits.shape[-1]
    rows = torch.arange(B, device=ids.device).repeat_interleave(K)  # (B*K,) the K beams of each row
    decoder.reorder(rows)
    logits = logits[rows]  # (B*K, V)
    tokens = torch.cat([ids, ids.new_zeros(B, max_new)], dim=1)[rows]  # (B*K, T + max_new)
    token_mask = None if mask is None else torch.cat([mask, mask.new_ones(B, max_new)], dim=1)[rows]
    beam_scores = torch.full((B, K), float("-inf"), device=ids.device)
    beam_scores[:, 0] = 0.0  # the K copies are identical: start from one so no beam is duplicated
    finished = [FinishedHypotheses(K, beams.length_penalty) for _ in range(B)]
    done = [False] * B
    n_candidates = min((1 + stop.numel()) * K, K * V)  # enough for K non-stop candidates
    for step in range(max_new):
        end = T + step
        state = SamplingState(params, tokens[:, :end], None if token_mask is None else token_mask[:, :end])
        log_probs = process(logits, state, STRATEGIES.get("beam").processors).log_softmax(-1)  # (B*K, V)
        candidates = (beam_scores.view(-1, 1) + log_probs).view(B, K * V)
        scores, index = torch.sort(candidates, dim=-1, descending=True, stable=True)
        scores, index = scores[:, :n_candidates], index[:, :n_candidates]  # (B, N)
        source, new_token = index // V, index % V  # (B, N) beam and token of each candidate
        is_stop = torch.isin(new_token, stop)
        add_finished(finished, done, tokens, scores, source, new_token, is_stop, K, T, end)
        keep = torch.sort(is_stop.int(), dim=-1, stable=True).indices[:, :K]  # first K non-stop (B, K)
        beam_scores = scores.gather(1, keep)
        flat = (torch.arange(B, device=ids.device)[:, None] * K + source.gather(1, keep)).view(-1)  # (B*K,)
        tokens = tokens[flat]
        tokens[:, end] = new_token.gather(1, keep).view(-1)
        best_running = beam_scores[:, 0].tolist()  # (B,) beams are sorted: the first is the best
        for row in range(B):
            if not done[row]:
                done[row] = finished[row].is_done(best_running[row], step + 1, max_new, beams.early_stopping)
            if done[row]:
                beam_scores[row] = float("-inf")  # a finished row adds nothing more
        if all(done) or step + 1 == max_new:
            break
        decoder.reorder(flat)
        logits = decoder.step(tokens[:, end])
    for row in range(B):  # beams still running at the end are hypotheses too
        for k in range(K):
            if math.isfinite(float(beam_scores[row, k])):
                finished[row].add(tokens[row * K + k, T:end + 1], float(beam_scores[row, k]))
    return [f.best for f in finished]


def add_finished(finished: list[FinishedHypotheses], done: list[bool], tokens: Tensor, scores: Tensor,
                 source: Tensor, new_token: Tensor, is_stop: Tensor, K: int, T: int, end: int) -> None:
    """Record stop-token candidates ranked within a row's first K (as Hugging Face does)."""
    ranked = is_stop[:, :K] & torch.isfinite(scores[:, :K])
    for row, rank in ranked.nonzero().tolist():
        if done[row]:
            continue
        beam = row * K + int(source[row, rank])
        hyp = torch.cat([tokens[beam, T:end], new_token[row, rank].view(1)])
        finished[row].add(hyp, float(scores[row, rank]))


def stack_hypotheses(best: list[Hypothesis], pad_id: int | None, device) -> Tensor:
    """Rows' best new tokens padded on the right to one (B, n) tensor (pad_id, else the stop token)."""
    n = max(len(hyp.tokens) for hyp in best)
    out = torch.empty(len(best), n, dtype=torch.long, device=device)
    for row, hyp in enumerate(best):
        fill = pad_id if pad_id is not None else int(hyp.tokens[-1])
        out[row] = fill
        out[row, :len(hyp.tokens)] = hyp.tokens
    return out
