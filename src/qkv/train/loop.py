"""The training loop: cross-entropy, AdamW, schedule, clipping, accumulation, evaluation, checkpoints.

One optimizer step (note 000 LLM §4-§6, §10.4):
    g = (1/k) sum_{micro-batches} grad CE       (accumulation: exactly the gradient of the whole batch)
    g <- g * min(1, c / ||g||_2)                (global-norm clipping, LLM §4.3)
    theta <- AdamW(theta, g, lr(step))          (LLM §4.1, decoupled decay)
"""
from __future__ import annotations

import contextlib
import math
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from torch import nn
from tqdm import tqdm

from qkv.config import RunConfig, TrainConfig
from qkv.data.dataset import Prepared
from qkv.errors import QkvError
from qkv.models import build_model
from qkv.train import checkpoint, objectives
from qkv.train.objectives import cross_entropy  # noqa: F401 (defined beside the objectives that use it)
from qkv.train.metrics import MetricsLog
from qkv.train.optim import OPTIMIZERS
from qkv.train.schedules import SCHEDULES

MAX_BAD_STEPS = 10  # consecutive non-finite steps before the run stops
HORIZON_CHECKS = (0.05, 0.2, 0.5)  # fractions of max_time at which the step horizon is re-estimated


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise QkvError(f"train.device={name!r} but no CUDA device is available; use cpu or auto")
    try:
        return torch.device(name)
    except RuntimeError:
        raise QkvError(f"train.device={name!r} is not a device; use auto, cpu, cuda or cuda:N") from None


def autocast(device: torch.device, precision: str):
    if precision == "fp32":
        return contextlib.nullcontext()
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    return torch.autocast(device_type=device.type, dtype=dtype)


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


class Trainer:
    def __init__(self, run_dir: Path, cfg: RunConfig, data: Prepared, *, progress: bool = True,
                 log: Callable[[str], None] = print):
        self.run_dir, self.cfg, self.data, self.log = Path(run_dir), cfg, data, log
        self.tc: TrainConfig = cfg.train
        self.progress = progress
        self.device = resolve_device(self.tc.device)
        if self.tc.threads:
            torch.set_num_threads(self.tc.threads)
        seed_everything(self.tc.seed)
        self.model = build_model(cfg.model).to(self.device)
        self.optimizer = OPTIMIZERS.get(self.tc.optimizer)(self.model, self.tc)
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=self.tc.precision == "fp16")
        self.objective = objectives.for_run(cfg)  # lm, mlm or seq2seq: its batches and its loss
        self.batches = self.objective.batches(data.train, data.tokenizer, cfg, batch_size=self.tc.batch_size,
                                              seed=self.tc.seed)
        self.objective.batches(data.val, data.tokenizer, cfg, batch_size=1, seed=0)  # fail now, not at eval
        self.state = State(horizon=self.tc.max_steps)
        self.bad_steps = 0

    # ---- state -------------------------------------------------------------------------------
    def resume(self) -> bool:
        """Load the last complete checkpoint; False when the run has none yet."""
        checkpoint.recover(self.run_dir)
        if not checkpoint.has_checkpoint(self.run_dir):
            return False
        tensors = checkpoint.read_tensors(self.run_dir / checkpoint.MODEL_FILE)
        checkpoint.load_model_tensors(self.model, tensors, str(self.run_dir / checkpoint.MODEL_FILE))
        state_tensors, raw = checkpoint.load_state(self.run_dir)
        checkpoint.load_optimizer(self.optimizer, state_tensors, raw["optimizer"])
        if "scaler" in raw:
            self.scaler.load_state_dict(raw["scaler"])
        self.state = State(**raw["trainer"])
        if not (self.tc.max_time and self.tc.time_horizon):  # --max-steps is the total, also after a resume
            self.state.horizon = self.tc.max_steps
        self.state.horizon = min(self.state.horizon, self.tc.max_steps)
        self.batches.load_state(self.state.batches)
        restore_rng(self.state.rng, state_tensors)
        return True

    def save(self) -> None:
        self.state.batches = self.batches.state()
        rng_json, rng_tensors = capture_rng()
        self.state.rng = rng_json
        optim_tensors, groups = checkpoint.optimizer_tensors(self.optimizer)
        raw = {"step": self.state.step, "trainer": vars(self.state), "optimizer": groups,
               "scaler": self.scaler.state_dict()}
        checkpoint.save(self.run_dir, self.model, {**optim_tensors, **rng_tensors}, raw)

    # ---- one step ----------------------------------------------------------------------------
    def lr(self, step: int) -> float:
        return SCHEDULES.get(self.tc.schedule)(
            step, lr=self.tc.lr, min_lr=self.tc.min_lr, warmup=self.tc.warmup_steps,
            total=self.state.horizon, d_model=self.cfg.model.d_model)

    def step(self, *batch: torch.Tensor, lr: float) -> tuple[float, float]:
        """One optimizer update over `accumulation` micro-batches of `batch` (the objective's tensors,
        e.g. inputs and targets); returns (loss, grad norm)."""
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        k = self.tc.accumulation
        total = torch.zeros((), device=self.device)
        for micro in zip(*(tensor.chunk(k) for tensor in batch)):
            with autocast(self.device, self.tc.precision):
                loss = self.objective.loss(self.model, micro, self.tc.label_smoothing)
            self.scaler.scale(loss / k).backward()
            total += loss.detach()
        self.scaler.unscale_(self.optimizer)
        max_norm = self.tc.grad_clip if self.tc.grad_clip > 0 else math.inf
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)
        loss_value, norm_value = (total / k).item(), norm.item()
        if math.isfinite(loss_value) and math.isfinite(norm_value):
            self.scaler.step(self.optimizer)
            self.bad_steps = 0
        else:
            self.bad_steps += 1
            self.log(f"step {self.state.step}: non-finite loss {loss_value} or gradient norm {norm_value}; "
                     "update skipped")
            if self.bad_steps >= MAX_BAD_STEPS and self.tc.precision != "fp16":
                raise QkvError(f"{MAX_BAD_STEPS} non-finite steps in a row at step {self.state.step}; "
                               "stopping (the last checkpoint is kept). Lower train.lr or enable grad_clip")
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        return loss_value, norm_value

    # ---- the loop ----------------------------------------------------------------------------
    def run(self) -> dict:
        tc, state = self.tc, self.state
        metrics = MetricsLog(self.run_dir / "metrics.csv", state.step)
        tokens_per_step = tc.batch_size * tc.seq_len
        bar = tqdm(total=state.horizon, initial=state.step, disable=not self.progress, unit="step",
                   dynamic_ncols=True, leave=False)
        session_start, window_start, window_tokens = time.perf_counter(), time.perf_counter(), 0
        elapsed_before, checks = state.elapsed, list(HORIZON_CHECKS)
        val = math.nan
        self.model.train()
        try:
            while state.step < state.horizon:
                batch = [torch.from_numpy(a).to(self.device) for a in self.batches.next()]
                lr = self.lr(state.step)
                loss, norm = self.step(*batch, lr=lr)
                state.step += 1
                state.tokens += tokens_per_step
                window_tokens += tokens_per_step
                state.elapsed = elapsed_before + time.perf_counter() - session_start
                checks = self.fit_horizon(checks, session_start)
                if tc.eval_every and state.step % tc.eval_every == 0 and state.step < state.horizon:
                    val = self.evaluate()
                if state.step % tc.log_every == 0 or state.step == state.horizon or not math.isnan(val):
                    rate = window_tokens / max(1e-9, time.perf_counter() - window_start)
                    metrics.write(step=state.step, loss=loss, val_loss=val, lr=lr, grad_norm=norm,
                                  tokens_per_s=rate, elapsed_s=state.elapsed)
                    bar.set_postfix(loss=f"{loss:.3f}", lr=f"{lr:.2e}", tok_s=f"{rate:,.0f}", refresh=False)
                    window_start, window_tokens, val = time.perf_counter(), 0, math.nan
                bar.total = state.horizon
                bar.update(1)
                if tc.checkpoint_every and state.step % tc.checkpoint_every == 0 and state.step < state.horizon:
                    self.save()
                if tc.max_time and state.elapsed >= tc.max_time:
                    break
        except KeyboardInterrupt:
            bar.close()
            self.save()
            raise
        bar.close()
        final_val = self.evaluate()
        metrics.write(step=state.step, val_loss=final_val, elapsed_s=state.elapsed)
        self.save()
        return {"steps": state.step, "tokens": state.tokens, "seconds": round(state.elapsed, 2),
                "tokens_per_s": round(state.tokens / max(1e-9, state.elapsed)),
                "val_loss": final_val, "best_val_loss": state.best_val}

    def evaluate(self) -> float:
        tc = self.tc
        loss = objectives.evaluate(self.objective, self.model, self.data.val, self.data.tokenizer, self.cfg,
                                   batch_size=max(1, tc.batch_size // tc.accumulation), batches=tc.eval_batches,
                                   seed=tc.seed + 1, device=self.device)
        self.state.best_val = min(self.state.best_val, loss)
        return loss

    def fit_horizon(self, checks: list[float], session_start: float) -> list[float]:
        """With max_time, re-estimate how many steps fit and stretch the LR schedule to end there."""
        tc, state = self.tc, self.state
        if not (tc.max_time and tc.time_horizon) or not checks or state.elapsed < checks[0] * tc.max_time:
            return checks
        seconds_per_step = state.elapsed / state.step
        remaining = max(0.0, tc.max_time - state.elapsed)
        state.horizon = min(tc.max_steps, state.step + max(1, int(remaining / seconds_per_step)))
        return [c for c in checks if state.elapsed < c * tc.max_time]


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
