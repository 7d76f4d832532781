"""A SIGKILL at an arbitrary moment of a checkpoint save (not a simulated one) leaves one complete set.

A child process saves checkpoints in a loop, each set's tensors filled with its own step number, and is
killed with SIGKILL at several delays; every time, `recover` + loading gives a set whose model tensors,
training-state tensors and JSON all carry the same step (never a mix of two saves, never a torn file).
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from qkv import files
from qkv.train import checkpoint

CHILD = textwrap.dedent("""
    import sys, torch
    from torch import nn
    from qkv.train import checkpoint
    run = sys.argv[1]
    model = nn.Linear(512, 512)  # 1 MiB of weights: a save takes long enough to be interrupted inside
    step = 0
    while True:
        step += 1
        with torch.no_grad():
            model.weight.fill_(step)
            model.bias.fill_(step)
        checkpoint.save(run, model, {"moments": torch.full((256, 512), float(step))}, {"step": step})
        print(step, flush=True)
""")


@pytest.mark.parametrize("delay", [0.35, 0.6, 0.85])
def test_sigkill_during_saves_leaves_one_complete_set(tmp_path, delay):
    run = tmp_path / "run"
    run.mkdir()
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2] / "src")}
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(run)], stdout=subprocess.PIPE, env=env)
    first = child.stdout.readline()  # one save has completed: from here on a set always exists
    assert first.strip(), "the child never saved"
    time.sleep(delay)
    child.send_signal(signal.SIGKILL)
    child.wait()
    checkpoint.recover(run)
    assert files.has_checkpoint(run)
    assert not (run / ".staging").exists() and not (run / ".commit").exists()
    weights = files.read_tensors(run / files.MODEL_FILE)
    tensors, state = checkpoint.load_state(run)
    step = state["step"]
    assert step >= int(first)
    assert float(weights["weight"].min()) == float(weights["weight"].max()) == step
    assert float(weights["bias"].min()) == step
    assert float(tensors["moments"].min()) == float(tensors["moments"].max()) == step
