"""Learning-rate schedules (note 000 §17.2; LLM part §4.2, §10.1).

Every schedule has the signature `(step, *, lr, min_lr, warmup, total, d_model) -> float`, where
`step` counts optimizer updates from 0 and `total` is the number of updates of the run, so the last
update is step `total - 1`: the decaying schedules reach `min_lr` there, not one step after the run.
"""
from __future__ import annotations

import math
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
