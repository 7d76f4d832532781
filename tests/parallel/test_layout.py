"""Distributed training (qkv.parallel.layout): 2 gloo processes reproduce one process.

One torchrun launch (tests/train/parallel_worker.py) trains under parallel.dp=2 with zero 0, 1, 2, 3 and
runs `qkv train` with dp=2, zero=3; the oracle is the single-process run of the same config (note 000 LLM
§7.1: the mean of the ranks' gradients is the gradient of the whole batch). Layout errors are checked in
this process with torchrun's environment variables set: they are raised before any process group exists.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from qkv.cli import main
from qkv.data.dataset import Batches
from qkv.files import CONFIG_FILE
from qkv.parallel import layout as parallel
from qkv.files import MODEL_FILE, read_tensors
from qkv.train.metrics import MetricsLog
from tests.train import setup_env, shared_dir, torchrun
from tests.train.parallel_worker import CHECKPOINT_STEP, STEPS, ZEROS, cli_args, run_config, train_recorded

RELATIVE = 1e-5  # fp32; the ranks sum the same products in another order


@pytest.fixture(scope="module")
def launched(tmp_path_factory) -> dict:
    """The worker's results (rank -> JSON), the oracle (the same config in one process: losses and rows of
    every batch, run first so that the token cache is filled before the ranks read it), the verse file and
    the output folder; launched once."""
    monkeypatch = pytest.MonkeyPatch()
    text = setup_env(monkeypatch, tmp_path_factory)
    out = shared_dir(tmp_path_factory, "parallel")
    single = train_recorded(out / "single", run_config(str(text)))
    try:
        torchrun(2, ["-m", "tests.train.parallel_worker", str(out), str(text)])
    finally:
        monkeypatch.undo()
    ranks = {r: json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)}
    return {"ranks": ranks, "single": single, "text": text, "out": out}


@pytest.fixture(scope="module")
def single(launched) -> tuple[list[float], list[list], list[float]]:
    return launched["single"]


@pytest.mark.parametrize("zero", ZEROS)
def test_data_parallel_losses_equal_one_process(launched, single, zero):
    """dp=2 with DDP, ZeRO-1, FSDP2 (zero 2 and 3): every reported loss (the global batch mean) and gradient
    norm (over the whole gradient, also when each rank holds shards) within 1e-5 relative of one process,
    over 10 steps with 2-step accumulation and clipping at 0.5 (below every norm: active at each step)."""
    want, want_norms = np.array(single[0]), np.array(single[2])
    for rank in (0, 1):
        got = launched["ranks"][rank][f"zero{zero}"]
        assert len(got["losses"]) == STEPS
        np.testing.assert_allclose(got["losses"], want, rtol=RELATIVE, atol=0)
        np.testing.assert_allclose(got["norms"], want_norms, rtol=RELATIVE, atol=0)
    assert np.ptp(want) > 0.05  # the runs really train: the losses move far more than the tolerance
    assert want_norms.min() > 0.5  # run_config clips at 0.5


def test_dp_shards_are_disjoint_and_cover_the_batch(launched, single):
    """Each step, rank r's rows are rows r::2 of the single process's batch: disjoint, together all of it."""
    for zero in ZEROS:
        for step, rows in enumerate(single[1]):
            shards = [launched["ranks"][rank][f"zero{zero}"]["rows"][step] for rank in (0, 1)]
            assert shards[0] == rows[0::2] and shards[1] == rows[1::2]


@pytest.mark.parametrize("dp", [2, 3, 4])
def test_layout_shard_matches_the_samplers_rule(dp):
    """Layout.shard picks what Batches(rank, world) draws: disjoint shards whose union is the batch."""
    tokens = np.arange(500) % 97
    batch = Batches(tokens, seq_len=8, batch_size=12, seed=3).next()[0]
    shards = [parallel.Layout(dp=dp, dp_rank=r).shard(batch) for r in range(dp)]
    for r, shard in enumerate(shards):
        drawn = Batches(tokens, seq_len=8, batch_size=12, seed=3, rank=r, world=dp).next()[0]
        np.testing.assert_array_equal(shard, drawn)
    rows = sorted(tuple(row) for shard in shards for row in shard)
    assert rows == sorted(tuple(row) for row in batch) and sum(len(s) for s in shards) == len(batch)


def loss_rows(run_dir: Path) -> list[tuple[str, float]]:
    return [(r["step"], float(r["loss"])) for r in MetricsLog.read(run_dir / "metrics.csv") if r["loss"]]


def test_zero3_checkpoint_resumes_in_one_process(launched, tmp_path, capsys):
    """`qkv train` under torchrun (dp=2, zero=3) for 5 steps, then --resume in one process to 10 == 10 steps
    in one process: losses and final weights within 1e-5 of the uninterrupted run (the Adam moments and the
    data position came back with the checkpoint, or the losses after step 5 would differ)."""
    cli_run = launched["out"] / "cli"
    assert launched["ranks"][0]["cli"]["rc"] == 0 and launched["ranks"][1]["cli"]["rc"] == 0
    assert launched["ranks"][1]["cli"]["stdout"] == ""  # rank 0 alone reports
    assert json.loads(launched["ranks"][0]["cli"]["stdout"].splitlines()[0])["steps"] == CHECKPOINT_STEP
    layout = json.loads((cli_run / CONFIG_FILE).read_text())["parallel"]
    assert (layout["dp"], layout["zero"]) == (2, 3)
    resumed = tmp_path / "resumed"
    os.rename(cli_run, resumed)  # the module's other tests do not need it
    text = launched["text"]
    assert main(cli_args(str(text), resumed)[:1] + ["--out", str(resumed), "--resume", "--max-steps", str(STEPS),
                                                      "--quiet", "--no-sample", "--set", "parallel.dp=1",
                                                      "--set", "parallel.zero=0"]) == 0
    assert main(cli_args(str(text), tmp_path / "one") + ["--max-steps", str(STEPS)]) == 0
    capsys.readouterr()
    got, want = loss_rows(resumed), loss_rows(tmp_path / "one")
    assert [step for step, _ in got] == [step for step, _ in want] == [str(s) for s in range(1, STEPS + 1)]
    np.testing.assert_allclose([loss for _, loss in got], [loss for _, loss in want], rtol=RELATIVE, atol=0)
    a, b = read_tensors(resumed / MODEL_FILE), read_tensors(tmp_path / "one" / MODEL_FILE)
    assert a.keys() == b.keys()
    for name in a:
        if name.endswith("k_proj.bias"):  # its gradient is 0 in exact arithmetic (softmax ignores a shift of
            continue  # every key by q.b), so Adam amplifies rounding noise into updates of either sign
        torch.testing.assert_close(a[name], b[name], rtol=RELATIVE, atol=1e-6, msg=name)


# ---- layouts that do not fit: exit 2, one line from rank 0, nothing from the others ---------------------
BAD_LAYOUTS = [
    (2, ["parallel.dp=1"], "world size 2"),
    (1, ["parallel.dp=2"], "world size 1"),
    (1, ["parallel.zero=1"], "needs parallel.dp > 1"),
    (4, ["parallel.dp=2", "parallel.tp=2"], "needs parallel.zero=2 or 3"),
    (3, ["parallel.tp=3"], "must divide model.n_heads=4"),
    (3, ["parallel.pp=3"], "larger than model.n_layers=2"),
    (2, ["parallel.dp=2", "train.batch_size=7"], "must split into parallel.dp=2"),
    (2, ["parallel.dp=2", "parallel.zero=3", "train.precision=fp16"], "use train.precision=bf16"),
    (2, ["parallel.pp=2", "parallel.microbatches=3"], "parallel.microbatches=3 must be at least parallel.pp=2"),
]


@pytest.mark.parametrize("world,sets,message", BAD_LAYOUTS)
def test_mis_sized_layout_exits_2_with_one_line_on_every_rank(world, sets, message, monkeypatch, tmp_path, capsys):
    """Raised in job.start before the data is read (the --data file does not even exist). Every rank says it in
    one line, the others than rank 0 with their rank: whichever exits first, torchrun stops the rest."""
    args = ["train", "--preset", "tiny", "--data", str(tmp_path / "missing.txt"), "--out", str(tmp_path / "r"),
            "--quiet"] + [item for s in sets for item in ("--set", s)]
    monkeypatch.setenv("WORLD_SIZE", str(world))
    for rank in range(world):
        monkeypatch.setenv("RANK", str(rank))
        assert main(args) == 2
        out, err = capsys.readouterr()
        assert out == ""
        prefix = "qkv: error: " if rank == 0 else f"qkv: error: rank {rank}: "
        assert err.count("\n") == 1 and err.startswith(prefix) and message in err, err
    assert not (tmp_path / "r").exists()


def test_resume_sets_only_the_layout(tmp_path, capsys):
    """--resume keeps the run's config: parallel.* may change (another layout), nothing else."""
    run = tmp_path / "r"
    run.mkdir()
    run_config("unused.txt").save(run / CONFIG_FILE)
    before = (run / CONFIG_FILE).read_bytes()
    assert main(["train", "--out", str(run), "--resume", "--set", "model.d_model=64"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "would change model.d_model" in err and "parallel.*" in err
    assert (run / CONFIG_FILE).read_bytes() == before
