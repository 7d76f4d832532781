"""One torchrun launch (2 processes, gloo) for tests/train/test_parallel.py; every rank runs, in order:

1. the Trainer under parallel.dp=2 with zero 0, 1, 2 and 3 for STEPS steps: each step's reported loss and
   gradient norm, and this rank's rows of every batch;
2. `qkv train` through the CLI under dp=2, zero=3 for CHECKPOINT_STEP steps (constant schedule), whose
   checkpoint the test resumes in one process; rank 0 also keeps the CLI's stdout.

Rank r writes OUT/rank{r}.json. Usage: torchrun --standalone --nproc-per-node 2 -m tests.train.parallel_worker OUT TEXT
"""
from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import os
import sys
from pathlib import Path

import torch

from qkv import presets
from qkv.cli import main as cli_main
from qkv.config import RunConfig
from qkv.data.sources import prepare_data
from qkv.train.loop import Trainer

STEPS = 10
CHECKPOINT_STEP = 5
ZEROS = (0, 1, 2, 3)


def run_config(text: str, *, dp: int = 1, zero: int = 0) -> RunConfig:
    """The tiny preset on `text`, fp32, no dropout, evaluation only at the end, logged every step; clipping
    active and 2 micro-batches per step (gradients communicated after the second only)."""
    cfg = presets.get("tiny").override([
        "data.vocab_size=280", "train.threads=1", "model.dropout=0.0", "train.eval_every=0", "train.log_every=1",
        f"train.max_steps={STEPS}", "train.grad_clip=0.5", "train.accumulation=2", f"parallel.dp={dp}",
        f"parallel.zero={zero}"])
    return dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, paths=(text,)))


def cli_args(text: str, out: Path) -> list[str]:
    """`qkv train` arguments shared by the distributed run and the single-process runs it is compared with."""
    return ["train", "--preset", "tiny", "--data", text, "--out", str(out), "--quiet", "--no-sample", "--json",
            "--set", "data.vocab_size=280", "--set", "train.threads=1", "--set", "model.dropout=0.0",
            "--set", "train.schedule=constant", "--set", "train.warmup_steps=2", "--set", "train.log_every=1"]


def train_recorded(run_dir: Path, cfg: RunConfig) -> tuple[list[float], list[list], list[float]]:
    """Train `cfg` with the Trainer; (reported loss of every step, this rank's input rows of every step,
    gradient norm before clipping of every step)."""
    prepared = prepare_data(cfg.data)
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, vocab_size=prepared.tokenizer.vocab_size))
    trainer = Trainer(run_dir, cfg, prepared, progress=False, log=lambda message: None)
    losses, rows, norms = [], [], []
    step = trainer.step

    def recorded(*batch: torch.Tensor, lr: float):
        result = step(*batch, lr=lr)
        losses.append(result.loss)
        norms.append(result.grad_norm)
        rows.append(batch[0].tolist())
        return result

    trainer.step = recorded
    run_dir.mkdir(parents=True, exist_ok=True)
    trainer.run()
    return losses, rows, norms


def main(out: str, text: str) -> None:
    out_dir = Path(out)
    rank = int(os.environ["RANK"])
    results = {}
    for zero in ZEROS:
        losses, rows, norms = train_recorded(out_dir / f"zero{zero}", run_config(text, dp=2, zero=zero))
        results[f"zero{zero}"] = {"losses": losses, "rows": rows, "norms": norms}
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        rc = cli_main(cli_args(text, out_dir / "cli") + ["--max-steps", str(CHECKPOINT_STEP), "--set",
                                                          "parallel.dp=2", "--set", "parallel.zero=3"])
    results["cli"] = {"rc": rc, "stdout": stdout.getvalue()}
    (out_dir / f"rank{rank}.json").write_text(json.dumps(results))


if __name__ == "__main__":
    main(*sys.argv[1:])
