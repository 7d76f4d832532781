"""Every layout through the real CLI: `torchrun --nproc-per-node N -m qkv train ...` (gloo, CPU) against the
same `qkv train` in one process, on the tiny preset for 12 steps with 2-step accumulation and clipping
active. Each layout's loss curve and final validation loss equal one process's within 1e-5 relative (note 000
LLM §7: each layout computes the gradient of the same batch), up to dp x tp x pp on 8 processes;
checkpoints move between layouts; two torchrun agents act as two nodes.
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from qkv.cli import main
from qkv.files import MODEL_FILE, read_tensors
from qkv.train.metrics import MetricsLog
from tests.train import REPO, launch_env, reserved_port, torchrun

STEPS = 12
RELATIVE = 1e-5


def args(text: Path, out: Path, *sets: str) -> list[str]:
    common = ["data.vocab_size=280", "train.threads=1", "model.dropout=0.0", "train.schedule=constant",
              "train.warmup_steps=2", "train.log_every=1", "train.accumulation=2", "train.grad_clip=0.5",
              f"train.max_steps={STEPS}", "train.eval_every=0", *sets]
    return ["train", "--preset", "tiny", "--data", str(text), "--out", str(out), "--quiet", "--no-sample",
            *[item for s in common for item in ("--set", s)]]


def launch(processes: int, cli: list[str]) -> None:
    """`torchrun --standalone --nproc-per-node processes -m qkv <cli>`; every rank must exit 0."""
    torchrun(processes, ["-m", "qkv", *cli])


def curve(run: Path) -> dict[str, list[float]]:
    rows = MetricsLog.read(run / "metrics.csv")
    steps = [r for r in rows if r["loss"]]
    return {"loss": [float(r["loss"]) for r in steps], "grad_norm": [float(r["grad_norm"]) for r in steps],
            "val": [float(r["val_loss"]) for r in rows if r["val_loss"]],
            "scale": [float(r["loss_scale"]) for r in steps if r["loss_scale"]],
            "skipped": [int(r["skipped"]) for r in steps]}


def assert_same_run(got: Path, want: Path, rtol: float = RELATIVE, steps: int = STEPS) -> None:
    a, b = curve(got), curve(want)
    assert len(a["loss"]) == len(b["loss"]) == steps
    np.testing.assert_allclose(a["loss"], b["loss"], rtol=rtol, atol=0)
    np.testing.assert_allclose(a["grad_norm"], b["grad_norm"], rtol=100 * rtol, atol=0)  # clipping is active
    np.testing.assert_allclose(a["val"][-1], b["val"][-1], rtol=rtol, atol=0)  # a resumed run has two
    assert a["scale"] == b["scale"] and a["skipped"] == b["skipped"]
    x, y = read_tensors(got / MODEL_FILE), read_tensors(want / MODEL_FILE)
    assert x.keys() == y.keys()
    errors = {name: float((x[name] - y[name]).norm() / y[name].norm()) for name in x
              if not name.endswith("k_proj.bias")}  # gradient 0 in exact arithmetic: Adam turns rounding
    assert max(errors.values()) < 10 * rtol, errors  # into updates; elsewhere 12 Adam steps amplify it a little


@pytest.fixture(scope="module")
def single(text, tmp_path_factory) -> Path:
    """The oracle: the same command in one process."""
    out = tmp_path_factory.mktemp("layouts") / "single"
    assert main(args(text, out)) == 0
    return out


# name: (processes, settings); 1-D, 2-D and 3-D (torchtitan's FSDP x TP x PP, which holds tp x pp and dp x tp);
# pp alone: the fp16 and two-node tests below; dp alone: tests/train/test_parallel.py
LAYOUTS = {
    "tp2": (2, ["parallel.tp=2"]),
    "dp2_pp2": (4, ["parallel.dp=2", "parallel.pp=2", "parallel.schedule=1f1b", "parallel.microbatches=2"]),
}
THREE_D = ["parallel.dp=2", "parallel.tp=2", "parallel.pp=2", "parallel.zero=3", "parallel.microbatches=2"]


@pytest.mark.parametrize("name", LAYOUTS)
def test_layout_equals_one_process(name, text, single, tmp_path):
    processes, sets = LAYOUTS[name]
    launch(processes, args(text, tmp_path / name, *sets))
    assert_same_run(tmp_path / name, single)


def test_dp_tp_pp_on_8_processes_equals_one_process(text, tmp_path):
    """The 3-D layout (FSDP2 x TP x PP, 8 processes: 48 s for 12 steps on 2 cores, so 4 here) against 4 steps
    in one process."""
    assert main(args(text, tmp_path / "one") + ["--max-steps", "4"]) == 0
    launch(8, args(text, tmp_path / "3d", *THREE_D) + ["--max-steps", "4"])
    assert_same_run(tmp_path / "3d", tmp_path / "one", steps=4)


def test_pipeline_fp16_overflows_and_skips_like_one_process(text, tmp_path):
    """fp16 with the loss scale doubling after every good step: overflows happen, and the pipeline's two
    stages skip them together, as one process does (its micro-batches as small as the pipeline's: 4 of 2
    rows, so the fp16 backward sees the same magnitudes)."""
    fp16 = ["train.precision=fp16", "train.loss_scale_window=1"]
    assert main(args(text, tmp_path / "one", *fp16, "train.accumulation=4")) == 0
    launch(2, args(text, tmp_path / "pp", *fp16, "parallel.pp=2", "parallel.microbatches=2"))
    assert_same_run(tmp_path / "pp", tmp_path / "one", rtol=1e-4)  # fp16 products: measured 3e-5 apart at the end
    assert curve(tmp_path / "one")["skipped"][-1] >= 2  # the test exercises the skips


def test_a_checkpoint_moves_into_a_pipeline(text, single, tmp_path):
    """6 steps in one process, resumed under dp=2 x pp=2 with zero=3 (FSDP2 over each stage) to 12: equal
    to 12 uninterrupted steps (weights and Adam moments cut into each stage's shards, data position and RNG
    came through; the gathered final checkpoint is one process's). The other way, pp to one process:
    tests/train/test_pipeline.py (gathered state) and test_parallel.py (zero 3 to one process)."""
    assert main(args(text, tmp_path / "to_pp") + ["--max-steps", str(STEPS // 2)]) == 0
    to_pp = ["parallel.dp=2", "parallel.zero=3", "parallel.pp=2", "parallel.microbatches=2"]
    launch(4, ["train", "--out", str(tmp_path / "to_pp"), "--resume", "--quiet", "--no-sample", "--max-steps",
               str(STEPS), *[item for s in to_pp for item in ("--set", s)]])
    assert_same_run(tmp_path / "to_pp", single)


def test_two_nodes_as_users_launch_them(text, single, tmp_path):
    """Two torchrun agents, `--nnodes 2 --node-rank 0|1` with the rendezvous on 127.0.0.1 (two "nodes" on
    this machine, one process each), a pipeline stage per node: the same run as one process."""
    port = reserved_port()
    cli = args(text, tmp_path / "nodes", "parallel.pp=2", "parallel.microbatches=2")
    agents = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(node),
                                "--nproc-per-node", "1", "--master-addr", "127.0.0.1", "--master-port", str(port),
                                "-m", "qkv", *cli], cwd=REPO, env=launch_env(), stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True) for node in (0, 1)]
    logs = [agent.communicate(timeout=300)[0] for agent in agents]
    assert [agent.returncode for agent in agents] == [0, 0], logs[0][-2000:] + logs[1][-2000:]
    assert_same_run(tmp_path / "nodes", single)


def test_a_refused_layout_exits_2_with_its_error_line(text, tmp_path):
    """Each torchrun rank leaves through `python -m qkv` with os._exit (src/qkv/__main__.py): its exit code
    and its flushed error line still come through."""
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           "-m", "qkv", *args(text, tmp_path / "run", "parallel.dp=3")], cwd=REPO,
                          env=launch_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if line.startswith("qkv: error:")]
    assert errors and all("3 processes, but this launch has world size 2" in line for line in errors), \
        proc.stderr[-2000:]
    assert "exitcode  : 2" in proc.stderr
    assert not (tmp_path / "run").exists()
