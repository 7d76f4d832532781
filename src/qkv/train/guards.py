"""What keeps a run honest when things go wrong: Ctrl-C deferred to the end of the step, loss spikes.

- SIGINT: the first Ctrl-C only sets a flag; the loop finishes the update in progress, saves a checkpoint and
  stops (exit 130). An interrupt in the middle of `backward` or `optimizer.step` would otherwise leave half of
  the parameters updated. A second Ctrl-C stops at once without saving: the last complete checkpoint stays.
- Skipped steps: a non-finite loss or gradient norm skips the update; max_bad_steps of them in a row stop
  the run without touching the last checkpoint.
- Spikes: a loss above `factor` x the median of the last `window` losses is reported (not skipped): a spike is
  information about the run (bad batch, too high an LR), not an error.
"""
from __future__ import annotations

import math
import signal
import statistics
import threading
from typing import Callable

from qkv.errors import QkvError

SPIKE_MIN_HISTORY = 10  # losses needed before a median means anything


class DeferredInterrupt:
    """`with DeferredInterrupt(log) as guard:` ... `if guard.requested:` save and stop."""

    def __init__(self, log: Callable[[str], None]):
        self.log, self.requested, self.previous = log, False, None

    def __enter__(self) -> "DeferredInterrupt":
        if threading.current_thread() is threading.main_thread():  # signals reach the main thread only
            self.previous = signal.signal(signal.SIGINT, self.handle)
        return self

    def __exit__(self, *exc) -> None:
        if self.previous is not None:
            signal.signal(signal.SIGINT, self.previous)
            self.previous = None

    def handle(self, signum, frame) -> None:
        if self.requested:
            raise KeyboardInterrupt  # the second Ctrl-C: now, without a save (the last checkpoint is complete)
        self.requested = True
        self.log("qkv: interrupt: finishing this step, then saving (Ctrl-C again to stop without saving)")


def is_spike(loss: float, recent: list[float], factor: float) -> bool:
    """loss > factor * median(recent), once `recent` holds SPIKE_MIN_HISTORY losses; factor 0 disables."""
    return bool(factor) and len(recent) >= SPIKE_MIN_HISTORY and loss > factor * statistics.median(recent)


class StepGuards:
    """The per-step checks of a run's state (qkv.train.checkpoint.State, updated in place): skipped
    non-finite updates, the stop after train.max_bad_steps of them in a row, and loss spikes."""

    def __init__(self, tc, log: Callable[[str], None]):
        self.tc, self.log = tc, log

    def count_skip(self, state, skipped: bool, loss: float, norm: float, loss_scale: float | None = None) -> None:
        state.bad_steps = state.bad_steps + 1 if skipped else 0
        state.skipped += skipped
        if skipped:
            scale = f"; loss scale now {loss_scale:g}" if loss_scale is not None else ""
            self.log(f"qkv: step {state.step + 1}: non-finite loss {loss} or gradient norm {norm}; "
                     f"update skipped{scale}")

    def check_bad_steps(self, state, saved_step: int | None) -> None:
        """Stop after train.max_bad_steps skipped steps in a row; the last checkpoint is not touched."""
        limit = self.tc.max_bad_steps
        if state.bad_steps < limit:
            return
        kept = "no checkpoint was written" if saved_step is None else f"the checkpoint at step {saved_step} is kept"
        raise QkvError(f"{limit} non-finite steps in a row (steps {state.step - limit + 1}-{state.step}); "
                       f"stopping, {kept}. Lower train.lr, set train.grad_clip or use train.precision=bf16/fp32")

    def track_spike(self, state, loss: float) -> None:
        """Report a loss above spike_factor x the running median of the last spike_window losses."""
        tc = self.tc
        if not math.isfinite(loss):
            return
        if is_spike(loss, state.recent_losses, tc.spike_factor):
            state.spikes += 1
            median = statistics.median(state.recent_losses)
            self.log(f"qkv: step {state.step}: loss spike {loss:.4f} (> {tc.spike_factor:g} x the running "
                     f"median {median:.4f} of the last {len(state.recent_losses)} losses)")
        state.recent_losses = (state.recent_losses + [loss])[-tc.spike_window:]
