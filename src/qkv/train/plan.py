"""The plan of a training run, printed before it starts: steps, tokens, the time a step takes on this machine
(measured) and the total. A plan longer than a day without a time budget is refused unless confirmed
(`qkv train --yes`): `qkv train --preset gpt2-124m` on a 2-core CPU would otherwise start a run of months
without a word.

The measurement runs the objective's loss, forward and backward in the run's precision (its autocast), on
rows drawn from the training data by a sampler of its own (the run's sampler and the RNG states are left as
they were), on the unwrapped model; the optimizer's update is not timed. One row runs first as a warm-up
(its time is the measurement only when it took over `WARM_ENOUGH_SECONDS`): a first pass pays for
allocations and kernel selection, and without this pass, and without the run's autocast, the default job's
plan said 0.74 s a step and 403 steps in 300 s where the run made 2,791 (0.11 s a step). Then one row is
timed; where a whole micro-batch would take under `WHOLE_BATCH_SECONDS` by that figure, the micro-batch
itself is timed (a small model's rows do not cost in proportion: a step's fixed costs dominate), else the one
row's time is multiplied by the rows of a step. Under torchrun the plan gives steps and tokens only (a rank
alone cannot run a sharded model's forward).
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from qkv.errors import QkvError

DAY = 86_400.0


@dataclass(frozen=True)
class Plan:
    steps: int  # optimizer steps still to take
    tokens: int  # tokens they read
    step_seconds: float | None  # the estimate of one step (None: not measured)
    max_time: float  # train.max_time (0: none): the run stops there whatever the steps say
    measured: str = ""  # how: "one row measured" or "a micro-batch of 8 rows measured"

    @property
    def seconds(self) -> float | None:
        if self.step_seconds is None:
            return None
        total = self.steps * self.step_seconds
        return min(total, self.max_time) if self.max_time else total

    def describe(self) -> str:
        text = f"qkv: plan: {self.steps:,} steps, {self.tokens:,} tokens"
        if self.step_seconds is not None:
            text += f"; about {duration(self.step_seconds)} a step on this machine ({self.measured})"
            text += f", {duration(self.steps * self.step_seconds)} in all"
        if self.max_time:
            if self.step_seconds:
                fit = min(self.steps, int(self.max_time / self.step_seconds))
                text += (f"; about {fit:,} steps fit --max-time {duration(self.max_time)}, and the schedule is "
                         "fitted to them")
            else:
                text += (f"; stopping at --max-time {duration(self.max_time)} (the schedule fitted to the steps "
                         "that fit)")
        return text


def duration(seconds: float) -> str:
    for unit, size in (("days", DAY), ("h", 3600.0), ("min", 60.0)):
        if seconds >= size:
            return f"{seconds / size:,.1f} {unit}"
    return f"{seconds:.2g} s"


def plan_of(trainer) -> Plan:
    tc, state = trainer.tc, trainer.state
    steps = max(0, state.horizon - state.step)
    step_seconds, measured = (None, "") if trainer.layout.distributed else measure_step(trainer)
    return Plan(steps=steps, tokens=steps * tc.batch_size * tc.seq_len, step_seconds=step_seconds,
                measured=measured, max_time=tc.max_time)


WHOLE_BATCH_SECONDS = 2.0  # a micro-batch estimated under this is timed whole
WARM_ENOUGH_SECONDS = 5.0  # a first pass this long is taken as the measurement


def measure_step(trainer) -> tuple[float, str]:
    """(seconds of a step's forwards and backwards, how they were measured)."""
    tc = trainer.tc
    micro = tc.batch_size // tc.accumulation  # rows of one forward
    one = rows_seconds(trainer, 1, warm_up=True)
    if one * micro < WHOLE_BATCH_SECONDS and micro > 1:
        return rows_seconds(trainer, micro) * tc.accumulation, f"a micro-batch of {micro} rows measured"
    return one * tc.batch_size, "one row measured"


def rows_seconds(trainer, rows: int, warm_up: bool = False) -> float:
    """Seconds of the objective's loss, forward and backward in the run's precision, on `rows` training rows
    (after an untimed pass over them first with `warm_up`, unless that pass took over `WARM_ENOUGH_SECONDS`:
    then a first pass's extra cost is small beside it, and a big model's plan is not delayed by a second)."""
    cpu, cuda = torch.get_rng_state(), (torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None)
    sampler = trainer.objective.batches(trainer.data.train, trainer.data.tokenizer, trainer.cfg, batch_size=rows,
                                        seed=trainer.tc.seed + 1)
    batch = tuple(torch.from_numpy(a).to(trainer.device) for a in sampler.next())
    model = trainer.model
    was_training = model.training
    model.train()

    def once() -> float:
        start = time.perf_counter()
        with trainer.autocast():
            loss = trainer.objective.loss(model, batch, 0.0)
        loss.backward()
        if trainer.device.type == "cuda":
            torch.cuda.synchronize(trainer.device)
        seconds = time.perf_counter() - start
        model.zero_grad(set_to_none=True)
        return seconds

    try:
        first = once()
        return first if not warm_up or first > WARM_ENOUGH_SECONDS else once()
    finally:
        model.zero_grad(set_to_none=True)
        model.train(was_training)
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)


def check_plan(trainer, log, confirmed: bool) -> Plan:
    """Print the plan; refuse one longer than a day with no time budget unless `confirmed`."""
    plan = plan_of(trainer)
    log(plan.describe())
    if not confirmed and not plan.max_time and plan.seconds is not None and plan.seconds > DAY:
        raise QkvError(f"this run would take about {duration(plan.seconds)} on this machine ({plan.steps:,} steps of "
                       f"about {duration(plan.step_seconds)}); pass --yes to start it anyway, or --max-time SECONDS "
                       "to stop it in time (the schedule is fitted to the budget)")
    return plan
