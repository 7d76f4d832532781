"""Continuous batching: requests join and leave one running batch between decoding steps.

One thread owns the model (`qkv serve`: the main thread, the HTTP side on another; THREADS). Each loop it (1)
drops the rows whose client went away, (2) admits waiting requests while there is room: those waiting
together are prefilled as one left-padded batch in a KV cache of their own, and their cache rows are joined to
the running batch's, (3) runs ONE decoding step for every row of the batch at once, (4) hands each row its
token and retires the rows that are done. A long request therefore never holds up a short one, and a new
request's prefill never resets the others.

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
from torch import Tensor, nn

from qkv.generate.compiled import next_logits
from qkv.generate.decode import eval_mode, pad_left
from qkv.nn.decoding_linear import decoding_linears
from qkv.generate.families import Seq2SeqDecoder
from qkv.generate.sampling import SamplingParams, SamplingState, argmax, draw, make_generator, process
from qkv.models.build import architecture_of
from qkv.models.decoder import DecoderLM
from qkv.nn.cache import KVCache
from qkv.nn.quant import dense_prompt
from qkv.serve.logprobs import Choice, choice_of, prompt_logprobs
from qkv.serve.rows import gather_rows


# The engine's intra-op threads on CPU where it runs on a thread of its own (Engine.start; `qkv serve` runs it
# on the main thread instead: Engine.run, torch's default threads there). Two OpenMP threads are slow from a
# thread that is not the main one: SmolLM2-135M int4 (2026-12-04, 2-core Xeon with AMX, the engine alone, 16
# requests of 64 tokens) made 27 tokens/s at batch 1 and 195 at batch 16 from a second thread with two
# threads, 39 and 173 with one, and 56 and 284 on the main thread with two (the 1.1M-parameter shakespeare
# model, 2026-12-01: 96 and 1,158 from a second thread with two, 310 and 2,684 with one, 272 and 3,200 on the
# main thread with two). `qkv serve --threads N` overrides it.
THREADS = 1
# Requests waiting together are prefilled as one left-padded batch (one forward instead of one each); this caps
# a group's rows x longest prompt (the forward's activations and attention grow with it).
PREFILL_TOKENS = 2048


class Busy(Exception):
    """The queue of waiting requests is full (the server answers 429)."""


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
        self.admitting: list[Job] = []  # the jobs being prefilled, between the queue and the batch
        self.cache: KVCache | None = None
        self.last: Tensor | None = None  # (B,) each row's newest token, fed at the next step
        self.calls: deque[Callable[[], None]] = deque()  # other model work (embeddings) run between steps
        self.wake = threading.Condition()
        self.stopping = False
        self.thread = threading.Thread(target=self.loop, name="qkv-engine", daemon=True)
        self.steps = 0  # decoding steps taken (batched): for the tests and the benchmark

    def start(self) -> "Engine":
        """Run the loop on a thread of its own."""
        self.thread.start()
        return self

    def run(self) -> None:
        """Run the loop on the calling thread until stop() (from another thread or a signal handler)."""
        self.loop()

    def stop(self, timeout: float = 30.0) -> None:
        """Cancel what waits and what runs, then end the loop (and wait for its own thread, if it has one)."""
        with self.wake:
            self.stopping = True
            self.wake.notify_all()
        if self.thread.is_alive() and self.thread is not threading.current_thread():
            self.thread.join(timeout)

    @property
    def load(self) -> tuple[int, int]:
        """(running rows, waiting jobs); a job being prefilled is running (it has left the queue, not yet
        joined the batch)."""
        admitting, rows = list(self.admitting), list(self.rows)
        joining = sum(not job.done and all(job is not row for row in rows) for job in admitting)
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
        """Move waiting jobs into the batch while it has room: each group of them prefilled together."""
        while len(self.rows) < self.max_batch:
            with self.wake:
                group = self.take(self.max_batch - len(self.rows))
                self.admitting = group  # counted as running by `load` from here
            if not group:
                return
            try:
                for job in group:
                    if job.cancelled:
                        self.finish(job, "cancelled")
                live = [job for job in group if not job.done]
                if live:
                    self.prefill(live)
            except Exception as exc:  # a bug: these requests fail, the batch goes on
                traceback.print_exc()
                for job in group:
                    if all(job is not row for row in self.rows):
                        self.finish(job, "cancelled", f"internal error: {type(exc).__name__}: {exc}")
            finally:
                self.admitting = []

    def take(self, room: int) -> list[Job]:
        """The next waiting jobs to prefill together (called holding `wake`): up to `room`, and only as many as
        keep the padded prompts within PREFILL_TOKENS (always one), all on one side of quant.DENSE_PROMPT (an int8
        layer takes a long prompt's products another way: qkv.nn.quant.dense_prompt); an encoder-decoder's one
        at a time."""
        group: list[Job] = []
        longest = 0
        while self.waiting and len(group) < room:
            longest_then = max(longest, len(self.waiting[0].prompt))
            if group and (self.seq2seq or (len(group) + 1) * longest_then > PREFILL_TOKENS
                          or dense_prompt(len(self.waiting[0].prompt)) != dense_prompt(len(group[0].prompt))):
                break
            group.append(self.waiting.popleft())
            longest = longest_then
        return group

    def prefill(self, jobs: list[Job]) -> None:
        """Read the jobs' prompts (a left-padded batch: each row computes what it would alone), choose each one's
        first token, and join the batch (the ones not already done)."""
        device = next(self.model.parameters()).device
        for job in jobs:
            job.generator = None if job.processors is None else make_generator(job.seed, device)
        if self.seq2seq:
            for job in jobs:
                self.prefill_source(job, device)
            return
        ids, mask = pad_left([job.prompt for job in jobs], 0)  # (k, T), 1 for tokens
        ids, mask = ids.to(device), mask.to(device)
        T = ids.shape[1]
        cache = self.model.new_cache(len(jobs), T, rings=True)  # (a sliding layer's: qkv.nn.cache)
        padded = mask if not bool(mask.all()) else None
        head = self.model.lm_head if isinstance(self.model, DecoderLM) else None  # applied where logits are
        out = self.model(ids, attention_mask=padded, cache=cache, **({"head": False} if head else {}))  # wanted
        joining = []
        for row, job in enumerate(jobs):  # (k, T, D) final-norm outputs (a decoder LM) or (k, T, V) logits
            job.tokens = list(job.prompt)
            wanted = out[row:row + 1, T - (len(job.prompt) if job.echo else 1):]  # the last, or the whole prompt
            if self.first_token(job, wanted if head is None else head(wanted)):
                joining.append((job, row))
        if joining:
            self.join(joining, cache)

    def prefill_source(self, job: Job, device) -> None:
        """An encoder-decoder's request: its source encoded, its decoder started; then a row of the batch."""
        ids = torch.tensor([job.prompt], dtype=torch.long, device=device)  # (1, T)
        job.decoder = Seq2SeqDecoder(self.model, ids, None, job.max_new + 1)
        start = torch.tensor([[job.decoder_start]], device=device)
        job.tokens = [job.decoder_start]
        if self.first_token(job, job.decoder.prefill(start, None)[None]):  # (1, 1, V)
            self.rows.append(job)

    def first_token(self, job: Job, logits: Tensor) -> bool:
        """After the prompt: (1, n, V) logits, n the prompt's length where its log-probabilities are echoed, else
        1. The prompt's entries, the first token; True when the job goes on to the batch."""
        if job.echo:
            job.on_prompt(prompt_logprobs(logits[0], job.prompt, job.top_logprobs or 0))
        if job.max_new == 0:
            self.finish(job, "length")
            return False
        return not self.emit(job, logits[:, -1])

    def step(self) -> None:
        """One decoding step for every row; retire the rows that are done."""
        self.steps += 1
        if self.seq2seq:
            for job in list(self.rows):
                logits = job.decoder.step(torch.tensor([job.tokens[-1]]))  # (1, V)
                if self.emit(job, logits):
                    self.rows.remove(job)
            return
        logits = next_logits(self.model, self.last, self.cache)  # (B, V); compiled where enabled (--compile)
        greedy = argmax(logits).tolist()  # every greedy row at once
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
            token = int(argmax(logits)) if greedy is None else greedy
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

    def join(self, joining: list[tuple[Job, int]], cache: KVCache) -> None:
        """Add prefilled jobs' cache rows (job, its row of `cache`) to the batch (module docstring: right-aligned
        columns)."""
        old = [] if self.cache is None else [(self.cache, row, self.columns(j)) for row, j in enumerate(self.rows)]
        self.rows.extend(job for job, _ in joining)
        parts = old + [(cache, row, self.columns(job)) for job, row in joining]
        # one column more than the rows can fill: a step never writes the cache's last column, as in generate
        # (the compiled step's graph is traced with n below the cache's size, and holds only while it is)
        self.cache = gather_rows(self.model, parts, room=1 + max(j.max_new - j.generated for j in self.rows))
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
