"""Learning-rate schedules (note 000 §17.2; LLM part §4.2, §10.1) and the batch-size schedule (LLM §10.2).

Every schedule has the signature `(step, *, lr, min_lr, warmup, total, d_model) -> float`, where
`step` counts optimizer updates from 0 and `total` is the number of updates of the run, so the last
update is step `total - 1`: the decaying schedules reach `min_lr` there, not one step after the run.

Batch-size warmup (LLM §10.2 "开始时用小批次，逐渐增加") and the scaling rule ("批次大小乘以k，学习率也乘以k"):
    rows(s) = B0 + floor((B - B0) s / W)  for s < W, else B      (B0 train.batch_warmup_start, W its steps)
    lr_eff(s) = schedule(s) * scale(rows(s) / base_batch)        (scale: none 1, linear r, sqrt sqrt(r))
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


LR_SCALING: Registry[Callable[[float], float]] = Registry("lr_scaling")
LR_SCALING.register("none")(lambda ratio: 1.0)
LR_SCALING.register("linear")(lambda ratio: ratio)  # Goyal et al. 2017; note 000 LLM §10.2
LR_SCALING.register("sqrt")(math.sqrt)  # Krizhevsky 2014 / Hoffer et al. 2017, often used with Adam
