"""Continuous batching: requests join and leave one running batch between decoding steps.

One thread owns the model. Each loop it (1) drops the rows whose client went away, (2) admits waiting
requests while there is room: each is prefilled on its own (its prompt, batch of one, in a KV cache of its
own) and its cache rows are joined to the running batch's, (3) runs ONE decoding step for every row of the
batch at once, (4) hands each row its token and retires the rows that are done. A long request therefore
never holds up a short one, and a new request's prefill never resets the others.

The batch's KV cache (qkv.nn.cache.KVCache) shares its columns between rows. A row's tokens are always its
LAST columns, as `qkv.generate.pad_left` lays out a batch of prompts: a row that joined later simply has
padding in the columns before its prompt (the cache's per-column padding flags), and its positions count its
own tokens only (the cache's per-column positions), so every row computes what it would compute alone.
Joining copies each row's last `n` columns into a new cache, right-aligned, with room for the longest
remaining request; when rows leave, the columns no remaining row needs are dropped once they are the
larger part of the cache (so the attention of each step spans the longest live row, not the longest ever).

Each row chooses its own token with its own settings and its own torch.Generator: greedy is argmax of the
logits; sampling runs qkv.generate.sampling's processors (temperature, top-k, top-p) and draws, exactly as
`qkv.generate.generate` does for one row, so a request's output does not depend on the other rows (tested
against `qkv generate`, alone and among 16 concurrent requests).

An encoder-decoder's requests each keep their own cached decoder (their sources differ in length and each
has its cross-attention K/V); they step one after another within the same loop.
"""
from __future__ import annotations

import threading
import traceback
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from qkv.generate.decode import eval_mode
from qkv.nn.decoding_linear import decoding_linears
from qkv.generate.families import Seq2SeqDecoder
from qkv.generate.sampling import SamplingParams, SamplingState, draw, make_generator, process
from qkv.models.build import architecture_of
from qkv.nn.cache import KVCache


# The server's default on CPU: one intra-op thread for the engine. Measured on the 2-core machine
# (2026-12-01, the 1.1M-parameter shakespeare model, greedy): from a thread that is not the main one, two
# intra-op threads made 96 tokens/s at batch 1 and 1,158 at batch 16, one thread 310 and 2,684; the main
# thread with two, 272 and 3,200. The HTTP side needs a core as well. `qkv serve --threads N` overrides it.
THREADS = 1


class Busy(Exception):
    """The queue of waiting requests is full (the server answers 429)."""


@dataclass(frozen=True)
class Choice:
    """One token chosen for one request: its id, log-probability and the top alternatives (if asked)."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(eq=False)
class Job:
    """One sequence to generate (one `choice` of one API request).

    `on_prompt(logprobs)` (echo only) gets the prompt's per-token Choices; `on_token(choice) -> bool` gets each
    new token and returns True to stop there (a stop string); `on_done(reason, error)` is called once:
    reason "stop" (a stop token or string), "length" (max_new tokens) or "cancelled"; error: a message or None.
    All three run on the engine's thread.
    """

    prompt: list[int]  # ids the model reads (decoder: the context; encoder-decoder: the source)
    max_new: int
    processors: tuple[str, ...] | None = None  # qkv.generate.sampling PROCESSORS, then a draw; None: greedy
    params: SamplingParams = field(default_factory=SamplingParams)
    seed: int | None = None
    stop_tokens: tuple[int, ...] = ()
    top_logprobs: int | None = None  # None: no logprobs; k >= 0: the chosen token's and the top k
    echo: bool = False  # the prompt's own logprobs (on_prompt)
    decoder_start: int | None = None  # encoder-decoder: the decoder's first token
    on_prompt: Callable[[list[Choice]], None] = lambda logprobs: None
    on_token: Callable[[Choice], bool] = lambda choice: False
    on_done: Callable[[str, "str | None"], None] = lambda reason, error: None
    cancelled: bool = False  # set by the client's side; the row leaves before the next step
    # engine state
    generated: int = 0
    tokens: list[int] = field(default_factory=list)
    generator: torch.Generator | None = None
    decoder: Seq2SeqDecoder | None = None  # encoder-decoder jobs only
    done: bool = False

    def cancel(self) -> None:
        self.cancelled = True


class Engine:
    """Runs Jobs with continuous batching on a background thread (module docstring)."""

    def __init__(self, model: nn.Module, *, max_batch: int = 16, max_queue: int = 64, threads: int | None = None):
        """`threads`: torch's intra-op threads on the engine's thread (None: torch's default; see THREADS)."""
        self.model, self.max_batch, self.max_queue, self.threads = model, max_batch, max_queue, threads
        self.seq2seq = architecture_of(model).prompt == "source"
        self.waiting: deque[Job] = deque()
        self.rows: list[Job] = []  # the running batch, in cache row order
        self.admitting: Job | None = None  # the job being prefilled, between the queue and the batch
        self.cache: KVCache | None = None
        self.last: Tensor | None = None  # (B,) each row's newest token, fed at the next step
        self.calls: deque[Callable[[], None]] = deque()  # other model work (embeddings) run between steps
        self.wake = threading.Condition()
        self.stopping = False
        self.thread = threading.Thread(target=self.loop, name="qkv-engine", daemon=True)
        self.steps = 0  # decoding steps taken (batched): for the tests and the benchmark

    def start(self) -> "Engine":
        self.thread.start()
        return self

    def stop(self, timeout: float = 30.0) -> None:
        """Cancel what waits and what runs, then end the thread."""
        with self.wake:
            self.stopping = True
            self.wake.notify_all()
        self.thread.join(timeout)

    @property
    def load(self) -> tuple[int, int]:
        """(running rows, waiting jobs); a job being prefilled is running (it has left the queue, not yet
        joined the batch)."""
        admitting, rows = self.admitting, list(self.rows)
        joining = admitting is not None and not admitting.done and all(job is not admitting for job in rows)
        return len(rows) + joining, len(self.waiting)

    def submit(self, *jobs: Job) -> None:
        """Queue jobs (all of one request, so all or none); Busy when the queue cannot take them."""
        with self.wake:
            if self.stopping:
                raise Busy("the server is shutting down")
            if len(self.waiting) + len(jobs) > self.max_queue + max(0, self.max_batch - len(self.rows)):
                raise Busy(f"{len(self.rows)} requests are running and {len(self.waiting)} waiting "
                           f"(--max-batch {self.max_batch}, queue of {self.max_queue})")
            self.waiting.extend(jobs)
            self.wake.notify_all()

    def call(self, fn: Callable[[], None]) -> None:
        """Run fn() on the engine's thread between two steps (model work that is not decoding)."""
        with self.wake:
            self.calls.append(fn)
            self.wake.notify_all()

    # ------------------------------------------------------------------------------------ the loop

    def loop(self) -> None:
        if self.threads:
            torch.set_num_threads(self.threads)  # this thread's own setting (OpenMP's is per thread)
        with torch.inference_mode(), eval_mode(self.model), decoding_linears(self.model):
            while True:
                with self.wake:
                    while not (self.stopping or self.waiting or self.rows or self.calls):
                        self.wake.wait()
                    if self.stopping:
                        break
                    calls, self.calls = list(self.calls), deque()
                for fn in calls:
                    fn()
                try:
                    self.drop_cancelled()
                    self.admit()
                    if self.rows:
                        self.step()
                except Exception as exc:  # a bug: fail the rows in flight, keep serving the next requests
                    traceback.print_exc()
                    self.fail_all(f"internal error: {type(exc).__name__}: {exc}")
        for job in list(self.waiting) + self.rows:
            self.finish(job, "cancelled")
        self.waiting.clear()
        self.rows, self.cache, self.last = [], None, None

    def admit(self) -> None:
        while len(self.rows) < self.max_batch:
            with self.wake:
                if not self.waiting:
                    return
                job = self.admitting = self.waiting.popleft()  # counted as running by `load` from here
            try:
                if job.cancelled:
                    self.finish(job, "cancelled")
                    continue
                self.prefill(job)
            except Exception as exc:  # a bug: this request fails, the batch goes on
                traceback.print_exc()
                self.finish(job, "cancelled", f"internal error: {type(exc).__name__}: {exc}")
            finally:
                self.admitting = None

    def prefill(self, job: Job) -> None:
        """Read the prompt alone, choose the first token, and join the batch (unless already done)."""
        device = next(self.model.parameters()).device
        job.generator = None if job.processors is None else make_generator(job.seed, device)
        ids = torch.tensor([job.prompt], dtype=torch.long, device=device)  # (1, T)
        if self.seq2seq:
            job.decoder = Seq2SeqDecoder(self.model, ids, None, job.max_new + 1)
            start = torch.tensor([[job.decoder_start]], device=device)
            job.tokens = [job.decoder_start]
            logits = job.decoder.prefill(start, None)[None]  # (1, 1, V)
        else:
            cache = self.model.new_cache(1, len(job.prompt) + max(job.max_new, 1))
            logits = self.model(ids, cache=cache)  # (1, T, V)
            job.tokens = list(job.prompt)
        if job.echo:
            job.on_prompt(prompt_logprobs(logits[0], job.prompt, job.top_logprobs or 0))
        if job.max_new == 0:
            return self.finish(job, "length")
        if self.emit(job, logits[:, -1]):
            return
        if self.seq2seq:
            self.rows.append(job)
        else:
            self.join(job, cache)

    def step(self) -> None:
        """One decoding step for every row; retire the rows that are done."""
        self.steps += 1
        if self.seq2seq:
            for job in list(self.rows):
                logits = job.decoder.step(torch.tensor([job.tokens[-1]]))  # (1, V)
                if self.emit(job, logits):
                    self.rows.remove(job)
            return
        logits = self.model(self.last[:, None], cache=self.cache)[:, -1]  # (B, V)
        greedy = logits.argmax(dim=-1).tolist()  # every greedy row at once
        done = [self.emit(job, logits[row:row + 1], greedy[row]) for row, job in enumerate(self.rows)]
        self.last = torch.tensor([job.tokens[-1] for job in self.rows], device=self.last.device)
        if any(done):
            self.keep([row for row, gone in enumerate(done) if not gone])

    def emit(self, job: Job, logits: Tensor, greedy: int | None = None) -> bool:
        """Choose job's next token from its (1, V) logits, hand it over; True when the job is done.
        A fault in one row's choice or callbacks ends that row alone, with the error; the others go on."""
        try:
            return self.choose(job, logits, greedy)
        except Exception as exc:
            traceback.print_exc()
            self.finish(job, "cancelled", f"internal error: {type(exc).__name__}: {exc}")
            return True

    def choose(self, job: Job, logits: Tensor, greedy: int | None) -> bool:
        if job.processors is None:
            token = int(logits.argmax(dim=-1)) if greedy is None else greedy
        else:
            state = SamplingState(job.params, torch.tensor([job.tokens]))
            token = int(draw(process(logits, state, job.processors), job.generator))
        job.tokens.append(token)
        job.generated += 1
        stop = job.on_token(choice_of(logits[0], token, job.top_logprobs))
        if stop or token in job.stop_tokens:
            self.finish(job, "stop")
        elif job.generated >= job.max_new:
            self.finish(job, "length")
        return job.done

    def finish(self, job: Job, reason: str, error: str | None = None) -> None:
        if not job.done:
            job.done = True
            job.decoder = None
            try:
                job.on_done(reason, error)
            except Exception:  # the request's own side failed; nothing more can be told to it
                traceback.print_exc()

    def drop_cancelled(self) -> None:
        gone = [row for row, job in enumerate(self.rows) if job.cancelled]
        for row in gone:
            self.finish(self.rows[row], "cancelled")
        if gone:
            if self.seq2seq:
                self.rows = [job for job in self.rows if not job.cancelled]
            else:
                self.keep([row for row in range(len(self.rows)) if row not in gone])

    def fail_all(self, message: str) -> None:
        for job in self.rows:
            self.finish(job, "cancelled", message)
        self.rows, self.cache, self.last = [], None, None

    # ------------------------------------------------------------------------------ the batch's cache

    def join(self, job: Job, cache: KVCache) -> None:
        """Add a prefilled job's cache row to the batch (module docstring: right-aligned columns)."""
        old = [] if self.cache is None else [(self.cache, row, self.columns(j)) for row, j in enumerate(self.rows)]
        self.rows.append(job)
        parts = old + [(cache, 0, cache.length)]
        self.cache = gather_rows(self.model, parts, room=max(j.max_new - j.generated for j in self.rows))
        device = cache.next_position.device
        self.last = torch.tensor([j.tokens[-1] for j in self.rows], dtype=torch.long, device=device)

    def keep(self, rows: list[int]) -> None:
        """Keep these rows of the batch; drop the columns no remaining row needs once they are most of it."""
        self.rows = [self.rows[row] for row in rows]
        if not self.rows:
            self.cache, self.last = None, None
            return
        index = torch.tensor(rows, dtype=torch.long, device=self.last.device)
        self.cache.reorder(index)
        self.last = self.last[index]
        needed = max(self.columns(job) for job in self.rows)
        if 2 * needed < self.cache.length:
            self.cache.keep_last(needed)

    def columns(self, job: Job) -> int:
        """The cache columns a row fills: its prompt and every generated token fed back so far."""
        return len(job.prompt) + job.generated - 1


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
