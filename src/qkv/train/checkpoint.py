"""Checkpoints: safetensors for tensors, JSON for everything else; never pickle.

A run dir (its layout and tensor I/O: qkv.files) holds config.json and tokenizer.json (written once) and the checkpoint set model.safetensors,
train_state.safetensors, train_state.json (rewritten at every checkpoint). A new set is written into
`.staging/` and fsynced; renaming `.staging` to `.commit` marks it complete; its files then replace the
old ones one by one and `.commit` is removed. A crash before the rename leaves the old set (the partial
`.staging` is discarded); a crash after it is rolled forward by `recover`. Either way one complete set.

The training state besides weights and moments (`State`: step, horizon, clock, data position, counters) is
JSON; the random generators' states go to the tensors (torch, NumPy's keys) and the JSON (Python's, NumPy's
position), so a resumed run draws exactly the numbers the uninterrupted one would have.
"""
from __future__ import annotations

import json
import math
import os
import random
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file
from torch import nn

from qkv.errors import QkvError
from qkv.files import (CHECKPOINT_FILES, MODEL_FILE, STATE_JSON, STATE_TENSORS, has_checkpoint, load_model_tensors,
                       model_tensors, read_tensors)
from qkv.train import parallel


@dataclass
class State:
    """Everything besides weights and moments that a resume needs, saved as JSON."""

    step: int = 0
    horizon: int = 0  # the step count the LR schedule is fitted to
    elapsed: float = 0.0  # training seconds over all sessions
    tokens: int = 0
    best_val: float = math.inf
    batches: dict = field(default_factory=dict)
    rng: dict = field(default_factory=dict)
    skipped: int = 0  # steps whose update was skipped (non-finite loss or gradients), all sessions
    bad_steps: int = 0  # skipped steps in a row, up to now
    spikes: int = 0
    recent_losses: list = field(default_factory=list)  # the last train.spike_window finite losses


class Checkpoints:
    """A run dir's checkpoint set as a training run in any layout sees it: every rank reads the same
    complete set on resume; rank 0 writes the single-process files, the full tensors gathered
    (docs/distributed.md). `sync` makes every rank's model the trained one first (the pipeline's)."""

    def __init__(self, model: nn.Module, optimizer, scaler, batches, layout, sync, log):
        self.model, self.optimizer, self.scaler = model, optimizer, scaler
        self.batches, self.layout, self.sync, self.log = batches, layout, sync, log

    def resume(self, run_dir: Path, tc) -> "State | None":
        """The saved State, with the weights, moments, loss scale, data position and RNG restored; None when
        the run has no training state (weights alone, if any, are loaded: fine-tuning starts from them)."""
        if self.layout.is_main:
            recover(run_dir)
        self.layout.barrier()  # every rank reads the same complete set
        weights = run_dir / MODEL_FILE
        if weights.is_file():  # also a run with weights only (imported, converted)
            load_model_tensors(self.model, read_tensors(weights), str(weights))
        if not has_checkpoint(run_dir):
            if weights.is_file():
                self.log(f"{run_dir}: weights without training state; fine-tuning them from step 0")
            return None
        state_tensors, raw = load_state(run_dir)
        parallel.load_full_optimizer(self.model, self.optimizer, state_tensors, raw["optimizer"], self.layout)
        if "scaler" in raw:
            self.scaler.load_state_dict(raw["scaler"])
        state = State(**raw["trainer"])
        if not (tc.max_time and tc.time_horizon):  # --max-steps is the total, also after a resume
            state.horizon = tc.max_steps
        state.horizon = min(state.horizon, tc.max_steps)
        self.batches.load_state(state.batches)
        restore_rng(state.rng, state_tensors)
        return state

    def save(self, run_dir: Path, state: "State") -> None:
        """Write `state` with the weights, moments, loss scale, data position and RNG (collective)."""
        state.batches = self.batches.state()
        rng_json, rng_tensors = capture_rng()
        state.rng = rng_json
        self.sync(self.optimizer)  # pipeline: each stage's weights and moments onto every rank
        weights = parallel.full_model_state(self.model, self.layout)
        optim_tensors, groups = parallel.full_optimizer_state(self.model, self.optimizer, self.layout)
        raw = {"step": state.step, "trainer": vars(state), "optimizer": groups, "scaler": self.scaler.state_dict()}
        if self.layout.is_main:
            write(run_dir, weights, {**optim_tensors, **rng_tensors}, raw)


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save(run_dir: Path, model: nn.Module, tensors: dict[str, torch.Tensor], state: dict) -> None:
    """Atomically replace the run's checkpoint set (see the module docstring)."""
    write(run_dir, model_tensors(model), tensors, state)


def write(run_dir: Path, weights: dict[str, torch.Tensor], tensors: dict[str, torch.Tensor], state: dict) -> None:
    """`save` with the model's tensors given (a distributed run gathers them first)."""
    run_dir = Path(run_dir)
    staging, commit = run_dir / ".staging", run_dir / ".commit"
    recover(run_dir)
    staging.mkdir()
    save_file(weights, str(staging / MODEL_FILE))
    save_file({k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}, str(staging / STATE_TENSORS))
    (staging / STATE_JSON).write_text(json.dumps(state, indent=1) + "\n")
    for name in CHECKPOINT_FILES:
        _fsync_file(staging / name)
    _fsync_dir(staging)
    os.rename(staging, commit)  # the commit point
    _fsync_dir(run_dir)
    recover(run_dir)


def recover(run_dir: Path) -> None:
    """Finish an interrupted save: roll a complete `.commit` forward, discard a partial `.staging`."""
    run_dir = Path(run_dir)
    commit, staging = run_dir / ".commit", run_dir / ".staging"
    if commit.is_dir():
        for name in CHECKPOINT_FILES:
            if (commit / name).exists():
                os.replace(commit / name, run_dir / name)
        _fsync_dir(run_dir)
        shutil.rmtree(commit)
    if staging.exists():
        shutil.rmtree(staging)


def load_state(run_dir: Path) -> tuple[dict[str, torch.Tensor], dict]:
    """The training state of the last complete checkpoint: (tensors, JSON state)."""
    run_dir = Path(run_dir)
    path = run_dir / STATE_JSON
    try:
        state = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise QkvError(f"{path}: corrupt training state ({exc})") from None
    if not isinstance(state, dict) or "step" not in state:
        raise QkvError(f"{path}: corrupt training state (no step)")
    return read_tensors(run_dir / STATE_TENSORS), state


def optimizer_tensors(optimizer: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], list[dict]]:
    """Flatten an optimizer's state to `optim.{index}.{key}` tensors plus JSON param groups."""
    sd = optimizer.state_dict()
    tensors = {}
    for index, entry in sd["state"].items():
        for key, value in entry.items():
            tensors[f"optim.{index}.{key}"] = torch.as_tensor(value)
    groups = [{k: v for k, v in g.items()} for g in sd["param_groups"]]
    return tensors, groups


def load_optimizer(optimizer: torch.optim.Optimizer, tensors: dict[str, torch.Tensor], groups: list[dict]) -> None:
    state: dict[int, dict] = {}
    for name, value in tensors.items():
        if name.startswith("optim."):
            _, index, key = name.split(".", 2)
            state.setdefault(int(index), {})[key] = value
    try:
        optimizer.load_state_dict({"state": state, "param_groups": groups})
    except (ValueError, KeyError, RuntimeError) as exc:
        raise QkvError(f"optimizer state does not match the model ({exc})") from None


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def capture_rng() -> tuple[dict, dict[str, torch.Tensor]]:
    version, internal, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state()
    json_state = {"python": [version, list(internal), gauss],
                  "numpy": [name, pos, has_gauss, cached]}
    tensors = {"rng.torch": torch.get_rng_state(), "rng.numpy_keys": torch.from_numpy(keys.astype(np.int64))}
    if torch.cuda.is_available():
        tensors["rng.cuda"] = torch.cuda.get_rng_state()
    return json_state, tensors


def restore_rng(json_state: dict, tensors: dict[str, torch.Tensor]) -> None:
    if not json_state:
        return
    version, internal, gauss = json_state["python"]
    random.setstate((version, tuple(internal), gauss))
    name, pos, has_gauss, cached = json_state["numpy"]
    np.random.set_state((name, tensors["rng.numpy_keys"].numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(tensors["rng.torch"])
    if "rng.cuda" in tensors and torch.cuda.is_available():
        torch.cuda.set_rng_state(tensors["rng.cuda"])
