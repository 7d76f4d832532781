"""Learning-rate schedules (note 000 §17.2; LLM part §4.2, §10.1) and the batch-size schedule (LLM §10.2).

Every schedule has the signature `(step, *, lr, min_lr, warmup, total, d_model) -> float`, where
`step` counts optimizer updates from 0 and `total` is the number of updates of the run, so the last
update is step `total - 1`: the decaying schedules reach `min_lr` there, not one step after the run.

Batch-size warmup (LLM §10.2 "开始时用小批次，逐渐增加") and the scaling rule ("批次大小乘以k，学习率也乘以k"):
    rows(s) = B0 + floor((B - B0) s / W)  for s < W, else B      (B0 train.batch_warmup_start, W its steps)
    lr_eff(s) = schedule(s) * scale(rows(s) / base_batch)        (scale: none 1, linear r, sqrt sqrt(r))

Sequence-length warmup (Li et al. 2022; not in the notes): each step trains on the first cols(s) columns,
    cols(s) = L0 (1 + floor((L / L0 - 1) s / W))  for s < W, else L   (L0 train.seq_warmup_start, W its steps)
in L / L0 equal stages of multiples of L0 (few shapes, each reused for many steps).
"""
from __future__ import annotations

import functools
import inspect
import math
import time
from typing import Callable

from qkv.registry import Registry

Schedule = Callable[..., float]
SCHEDULES: Registry[Schedule] = Registry("schedule")


def _warmup(step: int, lr: float, warmup: int) -> float:
    """Linear warmup lr * (step + 1) / warmup, so the first update already moves the weights."""
    return lr * (step + 1) / warmup


def _decay_progress(step: int, warmup: int, total: int) -> float:
    """0 at step `warmup`, 1 at the last step `total - 1` (and after)."""
    return min(1.0, (step - warmup) / max(1, total - 1 - warmup))


@SCHEDULES.register("constant")
def constant(step: int, *, lr: float, min_lr: float, warmup: int, total: int, d_model: int) -> float:
    return _warmup(step, lr, warmup) if step < warmup else lr


@SCHEDULES.register("cosine")
def cosine(step: int, *, lr: float, min_lr: float, warmup: int, total: int, d_model: int) -> float:
    """Warmup, then min_lr + (lr - min_lr) * (1 + cos(pi * progress)) / 2 from lr at step `warmup`
    down to min_lr at the last step `total - 1`."""
    if step < warmup:
        return _warmup(step, lr, warmup)
    progress = _decay_progress(step, warmup, total)
    return min_lr + 0.5 * (lr - min_lr) * (1.0 + math.cos(math.pi * progress))


@SCHEDULES.register("linear")
def linear(step: int, *, lr: float, min_lr: float, warmup: int, total: int, d_model: int) -> float:
    """Warmup, then a straight line from lr at step `warmup` to min_lr at the last step `total - 1`."""
    if step < warmup:
        return _warmup(step, lr, warmup)
    progress = _decay_progress(step, warmup, total)
    return lr + (min_lr - lr) * progress


@SCHEDULES.register("noam")
def noam(step: int, *, lr: float, min_lr: float, warmup: int, total: int, d_model: int) -> float:
    """lr * d_model^-0.5 * min(s^-0.5, s * warmup^-1.5), s = step + 1 (note 000 §17.2; "Attention Is
    All You Need" §5.3). `lr` is the paper's scale factor (1.0 in the paper); the peak is at s = warmup."""
    s = step + 1
    return lr * d_model ** -0.5 * min(s ** -0.5, s * max(1, warmup) ** -1.5)


# wsd's cooldown as a function of its progress p in [0, 1] (train.decay_shape): lr + (min_lr - lr) shape(p)
DECAY_SHAPES: Registry[Callable[[float], float]] = Registry("decay_shape")
DECAY_SHAPES.register("linear")(lambda p: p)
DECAY_SHAPES.register("sqrt")(math.sqrt)  # Hägele et al. 2024's "1 - sqrt" cooldown


@SCHEDULES.register("wsd")
def wsd(step: int, *, lr: float, min_lr: float, warmup: int, total: int, d_model: int,
        decay_fraction: float = 0.3, decay_shape: str = "linear") -> float:
    """Warmup-stable-decay (Hu et al. 2024, MiniCPM; Hägele et al. 2024): warmup, the flat peak lr, then from lr
    down to min_lr over the last `decay_fraction` of the run (train.decay_fraction), reaching min_lr at the last
    step `total - 1`: a straight line, or with decay_shape "sqrt" lr + (min_lr - lr) sqrt(p) (Hägele et al.'s
    "1 - sqrt" cooldown, which leaves the rate lower for longer; p the cooldown's progress)."""
    if step < warmup:
        return _warmup(step, lr, warmup)
    decay_start = max(warmup, total - 1 - round(decay_fraction * (total - warmup)))
    if step <= decay_start:
        return lr
    return lr + (min_lr - lr) * DECAY_SHAPES.get(decay_shape)(_decay_progress(step, decay_start, total))


def schedule_of(tc) -> Schedule:
    """train.schedule's function with the options only some schedules take (wsd: train.decay_fraction and
    train.decay_shape)."""
    fn = SCHEDULES.get(tc.schedule)
    if "decay_fraction" in inspect.signature(fn).parameters:
        return functools.partial(fn, decay_fraction=tc.decay_fraction, decay_shape=tc.decay_shape)
    return fn


ONECYCLE_DIV = 25.0  # OneCycle starts at lr / 25 (Smith & Topin 2018; torch's OneCycleLR div_factor)


@SCHEDULES.register("onecycle")
def onecycle(step: int, *, lr: float, min_lr: float, warmup: int, total: int, d_model: int) -> float:
    """OneCycle (note 000 LLM §10.1 "先线性增加到最大，再余弦衰减到最小"; Smith & Topin 2018): a straight line
    from lr / 25 at step 0 up to lr at step `warmup`, then cosine annealing down to min_lr at step `total - 1`.
    Equals torch's OneCycleLR with pct_start = (warmup + 1) / total, linear up and cosine down."""
    if step < warmup:
        start = lr / ONECYCLE_DIV
        return start + (lr - start) * step / warmup
    progress = _decay_progress(step, warmup, total)
    return min_lr + 0.5 * (lr - min_lr) * (1.0 + math.cos(math.pi * progress))


def batch_rows(step: int, *, batch_size: int, start: int, warmup_steps: int) -> int:
    """Rows of the batch used at `step`: a linear ramp from `start` to `batch_size` over `warmup_steps`."""
    if step >= warmup_steps:
        return batch_size
    return start + (batch_size - start) * step // warmup_steps


def seq_cols(step: int, *, seq_len: int, start: int, warmup_steps: int) -> int:
    """Columns of the batch used at `step`: start, 2 start, ... seq_len in equal stages over `warmup_steps`."""
    if step >= warmup_steps:
        return seq_len
    return start * (1 + (seq_len // start - 1) * step // warmup_steps)


LR_SCALING: Registry[Callable[[float], float]] = Registry("lr_scaling")
LR_SCALING.register("none")(lambda ratio: 1.0)
LR_SCALING.register("linear")(lambda ratio: ratio)  # Goyal et al. 2017; note 000 LLM §10.2
LR_SCALING.register("sqrt")(math.sqrt)  # Krizhevsky 2014 / Hoffer et al. 2017, often used with Adam


# ---------------------------------------------------------------------------------------- a step's LR and rows


def learning_rate(tc, step: int, *, horizon: int, d_model: int, rows: int | None = None) -> float:
    """schedule(step) * scale(rows / base_batch) (the linear scaling rule, note 000 LLM §10.2) for a
    TrainConfig `tc` whose schedule is fitted to `horizon` steps."""
    scheduled = schedule_of(tc)(step, lr=tc.lr, min_lr=tc.min_lr, warmup=tc.warmup_steps,
                                total=horizon, d_model=d_model)
    ratio = (rows or tc.batch_size) / (tc.base_batch or tc.batch_size)
    return scheduled * LR_SCALING.get(tc.lr_scaling)(ratio)


def step_rows(tc, step: int, dp: int = 1) -> int:
    """Rows of the batch used at `step` (batch-size warmup; batch_size once it is over), a multiple of the
    dp ranks so that each reads an equal shard (docs/distributed.md)."""
    rows = batch_rows(step, batch_size=tc.batch_size, start=tc.batch_warmup_start, warmup_steps=tc.batch_warmup_steps)
    return max(dp, rows - rows % dp)


def step_cols(tc, step: int) -> int:
    """Columns (tokens per row) used at `step`: the sequence-length warmup, then seq_len."""
    return seq_cols(step, seq_len=tc.seq_len, start=tc.seq_warmup_start, warmup_steps=tc.seq_warmup_steps)


# ---------------------------------------------------------------------------------------- the clock and the horizon

HORIZON_CHECKS = (0.05, 0.2, 0.5)  # fractions of max_time at which the step horizon is re-estimated
EARLY_END = 0.1  # a horizon reached with more than this fraction of max_time left is re-estimated too


class Clock:
    """Training seconds over all sessions, the throughput since the last logged row, and the time-budget
    fits still to come."""

    def __init__(self, elapsed_before: float):
        self.elapsed_before, self.session_start = elapsed_before, time.perf_counter()
        self.window_start, self.tokens = time.perf_counter(), 0
        self.checks = list(HORIZON_CHECKS)  # fractions of max_time still to fit the step horizon at
        self.fitted = (0.0, 0)  # (elapsed, step) of the last fit; the first fit averages the whole run

    def elapsed(self) -> float:
        return self.elapsed_before + time.perf_counter() - self.session_start

    def rate(self) -> float:
        """Tokens per second since the previous call; starts a new window."""
        now = time.perf_counter()
        rate = self.tokens / max(1e-9, now - self.window_start)
        self.window_start, self.tokens = now, 0
        return rate


def fit_horizon(tc, step: int, elapsed: float, horizon: int, clock: Clock) -> int:
    """The step horizon under a time budget (tc.max_time with tc.time_horizon): re-estimated at each check
    from the speed since the previous one (the first: since the run began), so a slow start (a busy machine,
    warm-up) does not cut the run short once the steps get faster; the LR schedule then ends there. A horizon
    that a sped-up run reaches before the next check, with more than EARLY_END of the budget left, is
    re-estimated there too, from the speed since the last fit: the run goes on instead of ending early."""
    if not (tc.max_time and tc.time_horizon):
        return horizon
    check_due = bool(clock.checks) and elapsed >= clock.checks[0] * tc.max_time
    ends_early = step >= horizon and elapsed < (1 - EARLY_END) * tc.max_time
    if not (check_due or ends_early):
        return horizon
    since_elapsed, since_step = clock.fitted
    seconds_per_step = (elapsed - since_elapsed) / max(1, step - since_step)
    remaining = max(0.0, tc.max_time - elapsed)
    clock.fitted = (elapsed, step)
    clock.checks = [c for c in clock.checks if elapsed < c * tc.max_time]
    return min(tc.max_steps, step + max(1, int(remaining / max(1e-9, seconds_per_step))))


def known_horizon(tc, horizon: int) -> int | None:
    """The run's length for a progress bar: unknown until a time budget's horizon is first fitted."""
    unfitted = tc.max_time and tc.time_horizon and horizon == tc.max_steps
    return None if unfitted else horizon
