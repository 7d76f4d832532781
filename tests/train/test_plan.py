"""qkv.train.plan: every run prints its plan before it starts; a plan of more than a day with no time budget is
refused (one error line, nothing written) unless --yes; the measurement leaves the run as it was."""
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
    monkeypatch.setattr(plan, "one_row_seconds", lambda trainer: 3600.0)  # an hour a row: days a step
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
    assert plan.one_row_seconds(trainer) > 0
    assert torch.equal(torch.get_rng_state(), state)
    assert all(p.grad is None for p in trainer.model.parameters())
    assert plan.duration(90_000) == "1.0 days" and plan.duration(0.5) == "0.5 s"

