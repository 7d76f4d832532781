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

import hashlib
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
from qkv.files import (CHECKPOINT_FILES, MODEL_FILE, RECORD_FILE, SET_FILES, STATE_JSON, STATE_TENSORS,
                       load_model_tensors, model_tensors, read_json, read_tensors)
from qkv.formats.run_dir import load_quantized


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
    (docs/distributed.md), gathered by the step runner (a pipeline's from its stages), and loaded back through it."""

    def __init__(self, model: nn.Module, optimizer, scaler, batches, layout, runner, log):
        self.model, self.optimizer, self.scaler = model, optimizer, scaler
        self.batches, self.layout, self.runner, self.log = batches, layout, runner, log

    def resume(self, run_dir: Path, tc) -> "State | None":
        """The saved State, with the weights, moments, loss scale, data position and RNG restored; None when
        the run has no training state (weights alone, if any, are loaded: fine-tuning starts from them)."""
        if self.layout.is_main:
            recover(run_dir)
        self.layout.barrier()  # every rank reads the same complete set
        kind = verify_set(run_dir)  # refuses an incomplete or altered set before anything is loaded
        if kind == "none":
            return None
        weights = run_dir / MODEL_FILE
        tensors = read_tensors(weights)
        load_quantized(self.model, tensors, str(weights))  # QLoRA's frozen codes (nothing for other runs)
        load_model_tensors(self.model, tensors, str(weights))
        if kind == "weights":  # a run with weights only (imported, converted)
            self.log(f"{run_dir}: weights without training state; fine-tuning them from step 0")
            return None
        state_tensors, raw = load_state(run_dir)
        check_state_json(raw, run_dir / STATE_JSON)
        check_optimizer_state(self.optimizer, state_tensors, raw, run_dir / STATE_TENSORS)
        self.runner.load_optimizer(self.optimizer, state_tensors, raw["optimizer"])  # cut to this layout
        try:
            if "scaler" in raw:
                self.scaler.load_state_dict(raw["scaler"])
            state = State(**raw["trainer"])
        except (TypeError, ValueError, KeyError, AttributeError) as exc:
            raise QkvError(f"{run_dir / STATE_JSON}: corrupt training state ({exc})") from None
        if not (tc.max_time and tc.time_horizon):  # --max-steps is the total, also after a resume
            state.horizon = tc.max_steps
        state.horizon = min(state.horizon, tc.max_steps)
        try:
            self.batches.load_state(state.batches)
            restore_rng(state.rng, state_tensors)
        except (TypeError, ValueError, KeyError, IndexError, AttributeError, RuntimeError) as exc:
            raise QkvError(f"{run_dir / STATE_JSON}: corrupt data position or RNG state ({exc})") from None
        return state

    def save(self, run_dir: Path, state: "State") -> None:
        """Write `state` with the weights, moments, loss scale, data position and RNG (collective)."""
        state.batches = self.batches.state()
        rng_json, rng_tensors = capture_rng()
        state.rng = rng_json
        weights, optim_tensors, groups = self.runner.full_state(self.optimizer)  # gathered on rank 0
        raw = {"step": state.step, "trainer": vars(state), "optimizer": groups, "scaler": self.scaler.state_dict()}
        if self.layout.is_main:
            bad = next((name for name, t in {**weights, **optim_tensors}.items()
                        if t.is_floating_point() and not bool(torch.isfinite(t).all())), None)
            if bad is not None:  # never replace a finite checkpoint with a diverged one
                raise QkvError(f"step {state.step}: {bad} is not finite; the checkpoint on disk was kept "
                               "(lower train.lr, or resume from it with other settings)")
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
    from safetensors import SafetensorError

    try:
        write_staging(staging, weights, tensors, state)
    except SafetensorError as exc:  # safetensors' own error for a failed write (a full disk)
        shutil.rmtree(staging, ignore_errors=True)
        raise QkvError(f"{staging}: cannot write the checkpoint ({exc}); the last one is kept") from None
    except BaseException:  # a full or read-only disk, an interrupt: no half-written set is left behind
        shutil.rmtree(staging, ignore_errors=True)
        raise
    os.rename(staging, commit)  # the commit point
    _fsync_dir(run_dir)
    recover(run_dir)


def write_staging(staging: Path, weights: dict[str, torch.Tensor], tensors: dict[str, torch.Tensor],
                  state: dict) -> None:
    save_file(weights, str(staging / MODEL_FILE))
    save_file({k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}, str(staging / STATE_TENSORS))
    (staging / STATE_JSON).write_text(json.dumps(state, indent=1) + "\n")
    record = {"step": state.get("step"), "files": {name: {"bytes": (staging / name).stat().st_size,
                                                          "sha256": sha256(staging / name)}
                                                   for name in CHECKPOINT_FILES}}
    (staging / RECORD_FILE).write_text(json.dumps(record, indent=1) + "\n")
    for name in SET_FILES:
        _fsync_file(staging / name)
    _fsync_dir(staging)


def recover(run_dir: Path) -> None:
    """Finish an interrupted save: roll a complete `.commit` forward, discard a partial `.staging`."""
    run_dir = Path(run_dir)
    commit, staging = run_dir / ".commit", run_dir / ".staging"
    if commit.is_dir():
        for name in SET_FILES:
            if (commit / name).exists():
                os.replace(commit / name, run_dir / name)
        _fsync_dir(run_dir)
        shutil.rmtree(commit)
    if staging.exists():
        shutil.rmtree(staging)


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def verify_set(run_dir: Path) -> str:
    """What a run dir's checkpoint is: "complete", "weights" (model.safetensors alone, as `qkv convert` or an
    import leaves it) or "none" (not saved yet); anything else is refused, nothing touched.

    A set with its record (checkpoint.json) must have every file it lists, each with its size and SHA-256.
    A set from before records existed must have all three files. A lone model.safetensors beside a
    metrics.csv is a trained run that lost its training state: refused too (resuming it would retrain from
    step 0 over what survived)."""
    run_dir = Path(run_dir)
    recovery = (f"nothing was changed; restore the file, or start a new run from these weights with "
                f"`qkv train --init {run_dir} --out NEW_DIR`")
    record_file = run_dir / RECORD_FILE
    if record_file.is_file():
        record = read_json(record_file)
        listed = record.get("files") if isinstance(record, dict) else None
        if not isinstance(listed, dict) or set(listed) != set(CHECKPOINT_FILES) or not all(
                isinstance(e, dict) and isinstance(e.get("bytes"), int) and isinstance(e.get("sha256"), str)
                for e in listed.values()):
            raise QkvError(f"{record_file}: not a checkpoint record (files with bytes and sha256); {recovery}")
        for name, entry in listed.items():
            path = run_dir / name
            if not path.is_file():
                raise QkvError(f"{run_dir}: the checkpoint of step {record.get('step')} is incomplete: {name} is "
                               f"missing; {recovery}")
            if path.stat().st_size != entry["bytes"] or sha256(path) != entry["sha256"]:
                raise QkvError(f"{path}: differs from the checkpoint record of step {record.get('step')} (size "
                               f"or SHA-256): corrupt or replaced; {recovery}")
        return "complete"
    present = [name for name in CHECKPOINT_FILES if (run_dir / name).is_file()]
    if len(present) == len(CHECKPOINT_FILES):
        return "complete"
    if not present:
        return "none"
    if present == [MODEL_FILE] and not (run_dir / "metrics.csv").is_file():
        return "weights"
    missing = [name for name in CHECKPOINT_FILES if name not in present]
    raise QkvError(f"{run_dir}: the checkpoint is incomplete: {', '.join(missing)} missing; {recovery}")


TRAINER_FIELDS = {name: type(value) for name, value in vars(State()).items()}


def check_state_json(raw, path: Path) -> None:
    """train_state.json's structure and types, before any value is used."""
    def bad(why: str) -> QkvError:
        return QkvError(f"{path}: corrupt training state ({why})")

    if not isinstance(raw, dict):
        raise bad("not a JSON object")
    for key, kind in (("step", int), ("trainer", dict), ("optimizer", list)):
        if not isinstance(raw.get(key), kind) or isinstance(raw.get(key), bool):
            raise bad(f"{key!r} must be {'an integer' if kind is int else 'a ' + kind.__name__}")
    if raw["step"] < 0:
        raise bad(f"step={raw['step']} is negative")
    trainer = raw["trainer"]
    unknown = sorted(set(trainer) - set(TRAINER_FIELDS))
    if unknown:
        raise bad(f"unknown trainer field {unknown[0]!r}")
    for key, value in trainer.items():
        kind = TRAINER_FIELDS[key]
        numeric = kind in (int, float) and isinstance(value, (int, float)) and not isinstance(value, bool)
        if not (numeric and (kind is float or isinstance(value, int)) or kind not in (int, float) and
                isinstance(value, kind)):
            raise bad(f"trainer.{key} must be {kind.__name__}, got {type(value).__name__}")
        if kind is int and value < 0:
            raise bad(f"trainer.{key}={value} is negative")
    if trainer.get("step", raw["step"]) != raw["step"]:
        raise bad(f"trainer.step={trainer['step']} differs from step={raw['step']}")
    if not all(isinstance(g, dict) and isinstance(g.get("params"), list) for g in raw["optimizer"]):
        raise bad("optimizer groups must be objects with params")
    if "scaler" in raw and not isinstance(raw["scaler"], dict):
        raise bad("scaler must be an object")


def check_optimizer_state(optimizer: torch.optim.Optimizer, tensors: dict[str, torch.Tensor], raw: dict,
                          path: Path) -> None:
    """Every optimizer tensor `optim.{i}.{key}` names a parameter of this optimizer and has its shape
    (a scalar for step), finite values; the groups hold the optimizer's parameter counts."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    groups = raw["optimizer"]
    if [len(g["params"]) for g in groups] != [len(g["params"]) for g in optimizer.param_groups]:
        raise QkvError(f"{path}: the optimizer state has groups of {[len(g['params']) for g in groups]} "
                       f"parameters; this model's optimizer has {[len(g['params']) for g in optimizer.param_groups]}")
    entries = {name: t for name, t in tensors.items() if name.startswith("optim.")}
    if raw["step"] > 0 and not entries:
        raise QkvError(f"{path}: no optimizer state, but the run is at step {raw['step']}")
    for name, value in entries.items():
        _, index, key = (name.split(".", 2) + ["", ""])[:3]
        if not index.isdigit() or int(index) >= len(params):
            raise QkvError(f"{path}: {name} names no parameter of this model ({len(params)} parameters)")
        shape = tuple(params[int(index)].shape)
        if key == "step":
            if value.numel() != 1:
                raise QkvError(f"{path}: {name} must be a scalar, has shape {tuple(value.shape)}")
        elif tuple(value.shape) != shape:
            raise QkvError(f"{path}: {name} has shape {tuple(value.shape)}; parameter {index} has {shape}")
        if not value.is_floating_point() and key != "step":
            raise QkvError(f"{path}: {name} is {value.dtype}, not floating point")
        if value.is_floating_point() and not bool(torch.isfinite(value).all()):
            raise QkvError(f"{path}: {name} has non-finite values")


def load_state(run_dir: Path) -> tuple[dict[str, torch.Tensor], dict]:
    """The training state of the last complete checkpoint: (tensors, JSON state)."""
    run_dir = Path(run_dir)
    path = run_dir / STATE_JSON
    try:
        state = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise QkvError(f"{path}: corrupt training state ({exc})") from None
    if not isinstance(state, dict) or not isinstance(state.get("step"), int) or isinstance(state["step"], bool) \
            or state["step"] < 0:
        raise QkvError(f"{path}: corrupt training state (step must be an integer >= 0)")
    return read_tensors(run_dir / STATE_TENSORS), state


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
