"""`qkv train --engine ref` (qkv.train.reference): the NumPy engine (no autograd) follows the torch
engine's loss curve end to end; what it refuses."""
from __future__ import annotations

import csv

import numpy as np

from qkv.cli import main
from tests.train import TINY, setup_env


def losses(run) -> dict[int, float]:
    with open(run / "metrics.csv", newline="") as f:
        return {int(row["step"]): float(row["loss"]) for row in csv.DictReader(f) if row["loss"]}


def test_reference_engine_trains_like_torch_from_the_cli(tmp_path, tmp_path_factory, monkeypatch):
    text = setup_env(monkeypatch, tmp_path_factory)
    common = [*TINY, "--data", str(text), "--max-steps", "10", "--set", "train.log_every=1", "--no-sample"]
    assert main(["train", *common, "--out", str(tmp_path / "torch")]) == 0
    assert main(["train", *common, "--engine", "ref", "--out", str(tmp_path / "ref")]) == 0
    torch_losses, ref_losses = losses(tmp_path / "torch"), losses(tmp_path / "ref")
    assert sorted(torch_losses) == sorted(ref_losses) == list(range(1, 11))
    steps = sorted(torch_losses)
    # the torch engine runs in float32 and the reference in float64 from the same weights and batches:
    # the curves agree to float32 rounding, carried through 10 AdamW steps
    np.testing.assert_allclose([ref_losses[s] for s in steps], [torch_losses[s] for s in steps], rtol=2e-5)
    assert ref_losses[10] < ref_losses[1] - 0.1  # and it learns


def test_check_engine_refuses_what_the_reference_run_cannot_do(monkeypatch):
    """The NumPy engine trains from step 0, for a number of steps, in one process: a resume, a time
    budget or a torchrun launch is refused before anything is written; the torch engine is never refused."""
    import pytest

    from qkv.errors import QkvError
    from qkv.train.reference import check_engine

    check_engine("torch", resume=True, max_time=300.0)
    check_engine("ref", resume=False, max_time=0.0)
    with pytest.raises(QkvError, match="cannot resume"):
        check_engine("ref", resume=True, max_time=0.0)
    with pytest.raises(QkvError, match="not a time budget"):
        check_engine("ref", resume=False, max_time=60.0)
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(QkvError, match="without torchrun"):
        check_engine("ref", resume=False, max_time=0.0)
