"""qkv.train.guards.StepGuards on a run's State: spikes against the running median, skipped steps counted,
the stop after max_bad_steps in a row with one line naming the steps and the checkpoint kept."""
import math

import pytest

from qkv.config import TrainConfig
from qkv.errors import QkvError
from qkv.train.checkpoint import State
from qkv.train.guards import StepGuards


def guards(**train):
    messages: list[str] = []
    return StepGuards(TrainConfig(**train), messages.append), State(), messages


def test_spike_needs_history_and_respects_the_factor():
    g, state, messages = guards(spike_factor=3.0, spike_window=12)
    for loss in [1.0] * 9:
        g.track_spike(state, loss)
    g.track_spike(state, 100.0)  # 9 losses of history: too few to judge
    assert state.spikes == 0
    g.track_spike(state, 2.9)  # the median of 10 losses is 1.0
    g.track_spike(state, 3.01)
    assert state.spikes == 1 and len(state.recent_losses) == 12 and len(messages) == 1
    g.track_spike(state, math.nan)  # not finite: skipped steps are counted elsewhere
    assert len(state.recent_losses) == 12


def test_skips_are_counted_and_a_good_step_resets_the_run_of_bad_ones():
    g, state, messages = guards(max_bad_steps=3)
    for skipped in (True, True, False, True):
        g.count_skip(state, skipped, math.nan if skipped else 1.0, 2.0, loss_scale=1024.0)
        state.step += 1
    assert (state.skipped, state.bad_steps) == (3, 1)
    assert messages[0] == "qkv: step 1: non-finite loss nan or gradient norm 2.0; update skipped; loss scale now 1024"
    g.check_bad_steps(state, saved_step=None)  # 1 < 3: goes on


@pytest.mark.parametrize("saved, kept", [(None, "no checkpoint was written"), (4, "the checkpoint at step 4 is kept")])
def test_max_bad_steps_in_a_row_stop_with_one_line(saved, kept):
    g, state, _ = guards(max_bad_steps=2)
    for _ in range(2):
        g.count_skip(state, True, math.inf, math.nan)
        state.step += 1
    with pytest.raises(QkvError) as info:
        g.check_bad_steps(state, saved_step=saved)
    assert str(info.value).startswith(f"2 non-finite steps in a row (steps 1-2); stopping, {kept}.")
