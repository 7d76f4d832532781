"""qkv.train.plan: every run prints its plan before it starts; a plan of more than a day with no time budget is
refused (one error line, nothing written) unless --yes; the measurement leaves the run as it was."""
import dataclasses

import pytest
import torch

from qkv.train import plan
from tests.cli.test_main import cli
from tests.train import TINY, setup_env


@pytest.fixture
def text(monkeypatch, tmp_path_factory):
    return setup_env(monkeypatch, tmp_path_factory)


def test_the_plan_is_printed_with_steps_tokens_and_the_measured_time(capsys, tmp_path, monkeypatch, text):
    code, _, err = cli(capsys, "train", *TINY, "--data", text, "--out", tmp_path / "run", "--max-steps", "6",
                       "--no-sample")
    assert code == 0
    line = next(line for line in err.splitlines() if line.startswith("qkv: plan:"))
    assert "6 steps, 1,536 tokens" in line and "a step on this machine" in line  # tiny: 8 rows x 32 tokens


def test_a_plan_longer_than_a_day_needs_yes_or_a_time_budget(capsys, tmp_path, monkeypatch, text):
    monkeypatch.setattr(plan, "rows_seconds", lambda trainer, rows, warm_up=False: 3600.0 * rows)  # days a step
    out = tmp_path / "run"
    code, out_text, err = cli(capsys, "train", *TINY, "--data", text, "--out", out, "--max-steps", "6", "--no-sample")
    errors = [line for line in err.splitlines() if line.startswith("qkv: error:")]
    assert code == 2 and len(errors) == 1 and "--yes" in errors[0] and "--max-time" in errors[0], err
    assert "Traceback" not in err and out_text == ""
    assert not out.exists()  # nothing written
    assert cli(capsys, "train", *TINY, "--data", text, "--out", tmp_path / "yes", "--max-steps", "2",
               "--no-sample", "--yes")[0] == 0
    code, _, err = cli(capsys, "train", *TINY, "--data", text, "--out", tmp_path / "budget", "--max-steps", "2",
                       "--max-time", "30", "--no-sample")
    assert code == 0 and "fit --max-time 30 s, and the schedule is fitted to them" in err


def test_measuring_leaves_the_rng_and_the_gradients_as_they_were(tmp_path, text):
    from qkv.train import job

    cfg = job.resolve_config(preset="tiny", config_file=None, overrides=["data.vocab_size=280"], data=[str(text)],
                             max_steps=3, max_time=None, task=None, init=None)
    trainer, _ = job.start(tmp_path / "r", cfg, resume=False, log=lambda m: None, progress=False)
    state = torch.get_rng_state()
    assert plan.rows_seconds(trainer, 1, warm_up=True) > 0 and plan.measure_step(trainer)[0] > 0
    assert torch.equal(torch.get_rng_state(), state)
    assert all(p.grad is None for p in trainer.model.parameters())
    assert plan.duration(90_000) == "1.0 days" and plan.duration(0.5) == "0.5 s"



def test_the_measurement_runs_warm_in_the_run_precision_and_times_a_small_micro_batch_whole(tmp_path, text,
                                                                                            monkeypatch):
    """The first pass over a row is not timed (it pays for allocations and kernel choice: the default job's
    plan once said 403 steps would fit where 2,791 did); the loss runs under the run's autocast; a micro-batch
    that one row says takes under 2 s is timed itself, and accumulation multiplies it."""
    from qkv.train import job

    cfg = job.resolve_config(preset="tiny", config_file=None, overrides=["data.vocab_size=280",
                             "train.precision=bf16", "train.accumulation=2"], data=[str(text)], max_steps=3,
                             max_time=None, task=None, init=None)
    trainer, _ = job.start(tmp_path / "r", cfg, resume=False, log=lambda m: None, progress=False)
    calls = []
    real_loss = trainer.objective.loss

    def loss(model, batch, smoothing):
        calls.append((batch[0].shape[0], torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu")))
        return real_loss(model, batch, smoothing)

    monkeypatch.setattr(trainer, "objective", dataclasses.replace(trainer.objective, loss=loss))
    seconds, measured = plan.measure_step(trainer)
    assert calls == [(1, True, torch.bfloat16)] * 2 + [(4, True, torch.bfloat16)]  # warm-up, one row, 8 / 2
    assert measured == "a micro-batch of 4 rows measured" and seconds > 0
    calls.clear()
    monkeypatch.setattr(plan, "WHOLE_BATCH_SECONDS", 0.0)  # every micro-batch "too long": one row x 8
    assert plan.measure_step(trainer)[1] == "one row measured" and [c[0] for c in calls] == [1, 1]
    calls.clear()
    monkeypatch.setattr(plan, "WARM_ENOUGH_SECONDS", 0.0)  # a first pass "long enough" is the measurement itself
    assert plan.measure_step(trainer)[1] == "one row measured" and [c[0] for c in calls] == [1]
