"""When the compiled decoding step (qkv.generate.compiled) is built: before the first token (warm_up:
`--compile`), or in the background, what generate, chat and serve do by default. The model decodes eagerly
from its first token while a thread at the lowest CPU priority traces the step on a twin of the model and
inductor compiles it; the step then takes over (Background), in one line on stderr (a chat between turns).
`qkv chat` on SmolLM2's Q4_1 file at int4, 2026-12-07, 2-core AMD EPYC (benchmarks/first_token.py): the first
reply began 3.9 s after the process started with an empty inductor cache and 4.3 s with a filled one; the step
took over after 295 s and 25 s of background compiling, and a 32-token reply took 0.57-0.62 s eagerly,
0.27-0.30 s compiled."""
from __future__ import annotations

import math
import os
import sys
import threading
import time
from copy import deepcopy

import torch
from torch import Tensor, nn

from qkv.generate.compiled import CompiledStep, compiled_step, unsupported
from qkv.generate.watch import kernel_operands
from qkv.nn.decoding_linear import decoding_linear, decoding_linears, stands_in_for
from qkv.nn.swap import swap


def warm_up(model: nn.Module, threads: int | None = None, rows: tuple[int, ...] = (1, 2),
            prompt: bool = False) -> float:
    """Compile `model`'s step for each count of `rows` (a server's batch needs 1 and 2: dynamic shapes keep a
    size-1 batch apart) and, with `prompt`, a short prompt's prefill (a chat: one graph for every later turn), with
    the intra-op threads it will decode with (inductor's kernels take their thread count when compiled); the
    seconds it took."""
    start = time.perf_counter()
    step = compiled_step(model)
    before = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        trace(step, rows, prompt)
    finally:
        torch.set_num_threads(before)
    return time.perf_counter() - start


def trace(step: CompiledStep, rows: tuple[int, ...], prompt: bool) -> None:
    """Run `step` once for each count of `rows` and, with `prompt`, a short prompt's prefill, on caches of
    its own: TorchDynamo traces each graph and inductor compiles it (or reads it from its cache)."""
    model = step.model
    with torch.inference_mode(), decoding_linears(model):  # (as generate, chat and the server decode)
        for count in rows:  # (caches of the kind generate, chat and serve decode with: sliding layers in rings)
            cache = model.new_cache(count, 3, rings=True)
            model(torch.zeros(count, 1, dtype=torch.long), cache=cache)
            step(torch.zeros(count, dtype=torch.long), cache)
        if prompt:
            step.prompt(torch.zeros(1, 2, dtype=torch.long), model.new_cache(1, 3, rings=True))


class Background:
    """A compiled step built on a thread of its own at the lowest CPU priority, while the model decodes
    eagerly at its own speed (`qkv chat`, `serve` and `generate` by default): the first token does not wait
    for the compiler (1.5-6 minutes the first time on 2 cores, 20-50 s from inductor's cache), and the step
    takes over when it is ready (take_over).

    The graphs are traced on a twin of the model (twin(): its own modules, the owner's tensors), so the
    owner's layers stay as the caller has them (generate swaps DecodingLinears in and out around each call;
    the twin keeps them for good) and nothing the eager decoding does meets the tracing. On Linux the thread
    runs at nice 19, and so do the compiler processes it starts: SmolLM2-135M at int4 decoded eagerly at
    19 ms a token beside it, as alone, against 140 ms beside the thread at the default priority (2026-12-07,
    2-core AMD EPYC); where the model decodes without pause, the compiler has only what is left of the CPU."""

    def __init__(self, step: CompiledStep, threads: int, rows: tuple[int, ...], prompt: bool,
                 announce=None):
        """`threads`: the intra-op threads the model decodes with (OpenMP's setting is per thread: this one's
        own is set so); `announce(line)`: told once, when the step takes over."""
        self.step, self.announce = step, announce
        self.seconds: float | None = None  # how long it took, once done
        self.done = threading.Event()
        self.thread = threading.Thread(target=self.work, args=(threads, rows, prompt), name="qkv-compile",
                                       daemon=True)  # (an exit does not wait for it)
        self.started = time.perf_counter()
        self.thread.start()

    def work(self, threads: int, rows: tuple[int, ...], prompt: bool) -> None:
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)  # this thread only (Linux)
        except (AttributeError, OSError):
            pass
        torch.set_num_threads(threads)
        sys.setprofile(self.yield_to_decoding)  # (this thread's calls only)
        try:
            self.step.build()
            trace(self.step, rows, prompt)
        except Exception as error:  # noqa: BLE001 - CompiledStep.run catches the compiler's own failures
            self.step.failed = f"{type(error).__name__}: {error}"
        finally:
            sys.setprofile(None)
        self.seconds = time.perf_counter() - self.started
        self.done.set()

    decoded = -math.inf  # time.monotonic() of the model's last eager token (usable() says, via decoding())
    QUIET = 0.05  # seconds without a token before the compiler runs again
    NAP = 0.02  # seconds it sleeps at a time meanwhile

    def decoding(self) -> None:
        """The model decodes a token eagerly now (CompiledStep.usable asks every token while this compiles)."""
        self.decoded = time.monotonic()

    def yield_to_decoding(self, frame, event, arg) -> None:
        """The compiling thread's profile function (every Python call it makes): while the model decodes, sleep.
        Whenever the compiler runs it holds the GIL for up to 5 ms at a time (Python's switch interval), and a
        token's 2,000 small eager operations each give the GIL up and take it back; nice 19 keeps the compiler
        off the cores only while the decoding fills them. With it, SmolLM2 int4's 24-token bursts 3 s apart
        (a chat, a server's requests) took 1.0 s beside the compiler against 0.5 alone (2026-12-07)."""
        if event == "call" and time.monotonic() - self.decoded < self.QUIET:
            while time.monotonic() - self.decoded < self.QUIET:
                time.sleep(self.NAP)

    def take_over(self, auto: bool = False) -> bool:
        """Switch the model's decoding to the compiled step if it is ready (and announce it); whether it did.
        `auto`: from usable(), where a caller that switches only between turns (a chat) has said not to."""
        if not self.done.is_set() or (auto and not self.automatic):
            return False
        step = self.step
        step.background = None
        if step.failed is None:
            step.on = True
            if self.announce is not None:
                self.announce(f"qkv: the compiled decoding step takes over (compiled in the background in "
                              f"{self.seconds:.0f} s; --no-compile decodes without it)")
        return step.on

    automatic = True  # usable() switches as soon as it is ready (a chat sets False: take_over between turns)

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for the compiler (tests; a caller that would rather wait); whether it is done."""
        return self.done.wait(timeout)


def twin(model: nn.Module) -> nn.Module:
    """A copy of `model`'s modules holding the very tensors `model` holds (parameters, buffers, and the
    tensors modules keep as attributes, in dicts, lists and tuples: quantized layers' kernel operands): a
    deepcopy with every tensor mapped to itself. ValueError where a tensor would still be copied."""
    memo: dict[int, object] = {}
    for tensor in tensors_held(model):
        memo[id(tensor)] = tensor
    step = model.__dict__.get("_qkv_compiled_step")
    if step is not None:
        memo[id(step)] = None  # (a step enabled before is not the twin's)
    copy = deepcopy(model, memo)
    if any(id(tensor) not in memo for tensor in tensors_held(copy)):
        raise ValueError("a tensor of the model's that a copy of its modules does not share")
    return copy


def tensors_held(model: nn.Module):
    """Every tensor `model`'s modules hold, as attributes or one container deep, the modules held as plain
    attributes (qkv.nn.fuse's fused layers) included."""
    seen: set[int] = set()
    waiting = [model]
    while waiting:
        module = waiting.pop()
        if id(module) in seen:
            continue
        seen.add(id(module))
        waiting += module._modules.values()
        for value in (*module.__dict__.values(), *module._parameters.values(), *module._buffers.values()):
            if isinstance(value, Tensor):
                yield value
            elif isinstance(value, nn.Module):
                waiting.append(value)
            elif isinstance(value, (dict, list, tuple)):
                for inner in (value.values() if isinstance(value, dict) else value):
                    if isinstance(inner, Tensor):
                        yield inner
                    elif isinstance(inner, (list, tuple)):
                        yield from (item for item in inner if isinstance(item, Tensor))


def enable_in_background(model: nn.Module, threads: int | None = None, rows: tuple[int, ...] = (1,),
                         prompt: bool = True, announce=None, automatic: bool = True,
                         summed: bool | frozenset | None = None) -> CompiledStep:
    """Decode `model` eagerly now and with a compiled step once a Background has built it (the graphs for
    `rows` and, with `prompt`, a short prompt's): it takes over by itself (`automatic`) or at take_over()
    (a chat, between turns). ValueError where the step does not apply."""
    reason = unsupported(model)  # (before the copy)
    if reason is not None:
        raise ValueError(f"the compiled decoding step does not cover {reason}")
    kernel_operands(model, make=True)  # (made on the owner, the twin then shares them)
    double = twin(model)
    swap(double, stands_in_for, decoding_linear)  # for good: each step of the twin would swap them in and out
    step = CompiledStep(double, summed, owner=model, build=False)
    object.__setattr__(model, "_qkv_compiled_step", step)
    step.background = Background(step, threads or torch.get_num_threads(), rows, prompt, announce)
    step.background.automatic = automatic
    return step


def take_over(model: nn.Module) -> bool:
    """Switch `model` to its compiled step if one compiled in the background is ready (a chat between turns);
    whether the compiled step decodes now."""
    step = compiled_step(model)
    if step is None:
        return False
    return step.on or (step.background is not None and step.background.take_over())
