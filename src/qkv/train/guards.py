"""What keeps a run honest when things go wrong: Ctrl-C deferred to the end of the step, loss spikes.

- SIGINT: the first Ctrl-C only sets a flag; the loop finishes the update in progress, saves a checkpoint and
  stops (exit 130). An interrupt in the middle of `backward` or `optimizer.step` would otherwise leave half of
  the parameters updated. A second Ctrl-C stops at once without saving: the last complete checkpoint stays.
- Spikes: a loss above `factor` x the median of the last `window` losses is reported (not skipped): a spike is
  information about the run (bad batch, too high an LR), not an error.
"""
from __future__ import annotations

import signal
import statistics
import threading
from typing import Callable

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
