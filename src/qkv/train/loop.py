"""The training loop: cross-entropy, AdamW, schedule, clipping, accumulation, evaluation, checkpoints.

One optimizer step (note 000 LLM §4-§6, §10.2, §10.4), over the b = rows(step) rows of the batch split
into micro-batches of batch_size / accumulation rows (b_i rows each):
    L_i = CE_i + alpha * aux_i                  (aux: the MoE balance loss, LLM §6.3; alpha train.aux_loss_weight)
    g = sum_i (b_i / b) grad L_i                (accumulation: exactly the gradient of the whole batch)
    g <- g * min(1, c / ||g||_2)                (global-norm clipping, LLM §4.3)
    theta <- AdamW(theta, g, lr(step))          (LLM §4.1, decoupled decay), unless g or the loss is not finite
fp16 multiplies the loss by a dynamic scale S before the backward and divides the gradients by S (LLM §6.2
"损失缩放"; torch's GradScaler): an overflow skips the update and halves S, loss_scale_window good steps in
a row double it. The weights and the optimizer stay fp32 (master weights); autocast runs the matmuls in
the low precision while softmax, norms and the loss compute in fp32 inside the model.
"""
from __future__ import annotations

import contextlib
import math
import random
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, NamedTuple

import numpy as np
import torch
from torch import nn
from tqdm import tqdm

from qkv import files
from qkv.analysis import flops
from qkv.config import RunConfig, TrainConfig
from qkv.data.dataset import Prepared
from qkv.errors import QkvError
from qkv.models import build_model
from qkv.nn.moe import MoE, aux_loss
from qkv.train import checkpoint, objectives, parallel, pipeline
from qkv.train.guards import DeferredInterrupt, is_spike
from qkv.train.metrics import open_logs
from qkv.train.optim import OPTIMIZERS
from qkv.train.schedules import LR_SCALING, SCHEDULES, batch_rows

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
    skipped: int = 0  # steps whose update was skipped (non-finite loss or gradients), all sessions
    bad_steps: int = 0  # skipped steps in a row, up to now
    spikes: int = 0
    recent_losses: list = field(default_factory=list)  # the last train.spike_window finite losses


class StepResult(NamedTuple):
    loss: float  # mean cross-entropy over the batch (the aux loss is not in it)
    grad_norm: float  # global L2 norm before clipping
    skipped: bool  # not finite: no update
    aux_loss: float = math.nan  # mean MoE balance loss (nan without MoE)


class Trainer:
    def __init__(self, run_dir: Path, cfg: RunConfig, data: Prepared, *, progress: bool = True,
                 log: Callable[[str], None] = print, layout: parallel.Layout | None = None):
        self.run_dir, self.cfg, self.data = Path(run_dir), cfg, data
        self.tc: TrainConfig = cfg.train
        # under torchrun: this rank's place (rank 0 alone logs, shows progress and writes the run dir)
        self.layout = layout or parallel.setup(cfg, resolve_device(self.tc.device))
        self.log = log if self.layout.is_main else (lambda message: None)
        self.progress = progress and self.layout.is_main
        self.device = self.layout.device
        if self.tc.threads:
            torch.set_num_threads(self.tc.threads)
        seed_everything(self.tc.seed)
        self.model = build_model(cfg.model).to(self.device)  # fp32 weights in every precision (master weights)
        self.flops_per_token = flops.train_flops_per_token(cfg.model, self.tc.seq_len)  # for MFU (qkv calc)
        self.peak_flops = self.tc.peak_flops or (flops.peak_flops_for(torch.cuda.get_device_name(self.device))
                                                 if self.device.type == "cuda" else None)
        # from outside, in torchtitan's order: tensor parallel, activation checkpointing, DDP / FSDP2;
        # self.model keeps the parameter names, self.wrapped is what the training forward calls
        # parallel.pp: this rank's stage of the blocks, wrapped alike, runs under a pipeline schedule
        self.pipeline = pipeline.Pipeline(
            self.model, self.layout.mesh["pp"], cfg, self.device, dp=self.layout.dp,
            wrap=lambda stage: parallel.parallelize(stage, cfg, self.layout)) if self.layout.pp > 1 else None
        self.wrapped = self.model if self.pipeline else parallel.parallelize(self.model, cfg, self.layout)
        self.has_moe = any(isinstance(module, MoE) for module in self.model.modules())
        optimizer = OPTIMIZERS.get(self.tc.optimizer)(self.model, self.tc)  # after FSDP2: over its shards
        self.optimizer = parallel.shard_optimizer(optimizer, self.layout)  # zero=1
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=self.tc.precision == "fp16",
                                           growth_interval=self.tc.loss_scale_window)
        self.objective = objectives.for_run(cfg)  # lm, mlm or seq2seq: its batches and its loss
        self.batches = self.objective.batches(data.train, data.tokenizer, cfg, batch_size=self.tc.batch_size,
                                              seed=self.tc.seed)
        self.objective.batches(data.val, data.tokenizer, cfg, batch_size=1, seed=0)  # fail now, not at eval
        self.state = State(horizon=self.tc.max_steps)
        self.saved_step: int | None = None  # the step of the last complete checkpoint, None before one

    # ---- state -------------------------------------------------------------------------------
    def resume(self) -> bool:
        """Load the last complete checkpoint; False when the run has none yet."""
        if self.layout.is_main:
            checkpoint.recover(self.run_dir)
        self.layout.barrier()  # every rank reads the same complete set
        weights = self.run_dir / files.MODEL_FILE
        if weights.is_file():  # also a run with weights only (imported, converted): fine-tuning starts there
            files.load_model_tensors(self.model, files.read_tensors(weights), str(weights))
        if not files.has_checkpoint(self.run_dir):
            if weights.is_file():
                self.log(f"{self.run_dir}: weights without training state; fine-tuning them from step 0")
            return False
        state_tensors, raw = checkpoint.load_state(self.run_dir)
        parallel.load_full_optimizer(self.model, self.optimizer, state_tensors, raw["optimizer"], self.layout)
        if "scaler" in raw:
            self.scaler.load_state_dict(raw["scaler"])
        self.state = State(**raw["trainer"])
        if not (self.tc.max_time and self.tc.time_horizon):  # --max-steps is the total, also after a resume
            self.state.horizon = self.tc.max_steps
        self.state.horizon = min(self.state.horizon, self.tc.max_steps)
        self.batches.load_state(self.state.batches)
        restore_rng(self.state.rng, state_tensors)
        self.saved_step = self.state.step
        return True

    def save(self) -> None:
        self.state.batches = self.batches.state()
        rng_json, rng_tensors = capture_rng()
        self.state.rng = rng_json
        # any layout writes the single-process files: full tensors gathered to rank 0 (docs/distributed.md)
        if self.pipeline:  # each stage's weights and optimizer state onto every rank's whole model
            self.pipeline.sync(self.optimizer)
        weights = parallel.full_model_state(self.model, self.layout)
        optim_tensors, groups = parallel.full_optimizer_state(self.model, self.optimizer, self.layout)
        raw = {"step": self.state.step, "trainer": vars(self.state), "optimizer": groups,
               "scaler": self.scaler.state_dict()}
        if self.layout.is_main:
            checkpoint.write(self.run_dir, weights, {**optim_tensors, **rng_tensors}, raw)
        self.saved_step = self.state.step

    def gather(self) -> None:
        """End a distributed run: rank 0 swaps in a plain single-device model holding the full weights (for
        the summary and the sample), then every rank leaves the process group. Collective."""
        if not self.layout.distributed:
            return
        if self.pipeline:
            self.pipeline.sync()
        weights = parallel.full_model_state(self.model, self.layout)
        if self.layout.is_main:
            self.model = self.wrapped = build_model(self.cfg.model).to(self.device)
            files.load_model_tensors(self.model, weights, "the gathered weights")
        parallel.shutdown()

    # ---- one step ----------------------------------------------------------------------------
    def lr(self, step: int, rows: int | None = None) -> float:
        """schedule(step) * scale(rows / base_batch) (the linear scaling rule, note 000 LLM §10.2)."""
        tc = self.tc
        scheduled = SCHEDULES.get(tc.schedule)(step, lr=tc.lr, min_lr=tc.min_lr, warmup=tc.warmup_steps,
                                               total=self.state.horizon, d_model=self.cfg.model.d_model)
        ratio = (rows or tc.batch_size) / (tc.base_batch or tc.batch_size)
        return scheduled * LR_SCALING.get(tc.lr_scaling)(ratio)

    def rows(self, step: int) -> int:
        """Rows of the batch used at `step` (batch-size warmup; batch_size once it is over)."""
        tc = self.tc
        rows = batch_rows(step, batch_size=tc.batch_size, start=tc.batch_warmup_start,
                          warmup_steps=tc.batch_warmup_steps)
        return max(self.layout.dp, rows - rows % self.layout.dp)  # dp equal shards (docs/distributed.md)

    def step(self, *batch: torch.Tensor, lr: float) -> StepResult:
        """One optimizer update over `batch` (the objective's tensors, e.g. inputs and targets, b rows each;
        b / dp on each rank under data parallel) in micro-batches of batch_size / accumulation rows."""
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        # under data parallel `batch` is this rank's b / dp rows; DDP / FSDP2 average the gradients over
        # the ranks (note 000 LLM §7.1), which makes g the gradient of the global batch
        rows, micro_rows = len(batch[0]), self.tc.batch_size // self.tc.accumulation // self.layout.dp
        micros = list(zip(*(tensor.split(micro_rows) for tensor in batch)))
        total = torch.zeros((), device=self.device)
        aux_total = torch.zeros((), device=self.device)
        if self.pipeline is not None:  # the schedule runs parallel.microbatches micro-batches instead
            micros = []
            with autocast(self.device, self.tc.precision):
                total = self.pipeline.forward_backward(*batch)  # the batch mean, on every stage
        for i, micro in enumerate(micros):
            share = len(micro[0]) / rows  # b_i / b: 1 / accumulation for a full batch
            with parallel.grad_sync(self.wrapped, enabled=i == len(micros) - 1):  # communicate once per step
                loss, aux = self.backward(micro, share)
            total += loss * share
            aux_total += aux * share
        total, aux_total = self.layout.dp_mean(total), self.layout.dp_mean(aux_total)  # global batch means
        self.scaler.unscale_(self.optimizer)  # fp16: g / S, recording whether any is inf or NaN
        max_norm = self.tc.grad_clip if self.tc.grad_clip > 0 else math.inf
        norm = (self.pipeline.clip_grad_norm(max_norm) if self.pipeline else  # over all stages
                parallel.clip_grad_norm(self.model.parameters(), max_norm))  # also over FSDP2 / TP shards
        loss_value, norm_value = total.item(), norm.item()
        skipped = not (math.isfinite(loss_value) and math.isfinite(norm_value))
        if not skipped:
            self.scaler.step(self.optimizer)
        self.scaler.update()  # fp16: halve S after an overflow, double it after loss_scale_window good steps
        self.optimizer.zero_grad(set_to_none=True)
        self.count_skip(skipped, loss_value, norm_value)
        return StepResult(loss_value, norm_value, skipped, aux_total.item() if self.has_moe else math.nan)

    def backward(self, micro: tuple[torch.Tensor, ...], share: float) -> tuple[torch.Tensor, torch.Tensor]:
        """Forward and backward of one micro-batch, its gradient weighted by `share`; (loss, aux) detached."""
        with autocast(self.device, self.tc.precision):
            loss = self.objective.loss(self.wrapped, micro, self.tc.label_smoothing)
        objective, aux = loss, torch.zeros((), device=self.device)
        if self.has_moe:  # B8: + alpha * the balance loss of this forward (note 000 LLM §6.3)
            aux = aux_loss(self.model)
            objective = loss + self.tc.aux_loss_weight * aux
        self.scaler.scale(objective * share).backward()
        return loss.detach(), aux.detach()

    def count_skip(self, skipped: bool, loss: float, norm: float) -> None:
        state = self.state
        state.bad_steps = state.bad_steps + 1 if skipped else 0
        state.skipped += skipped
        if skipped:
            scale = f"; loss scale now {self.scaler.get_scale():g}" if self.scaler.is_enabled() else ""
            self.log(f"qkv: step {state.step + 1}: non-finite loss {loss} or gradient norm {norm}; "
                     f"update skipped{scale}")

    def check_bad_steps(self) -> None:
        """Stop after train.max_bad_steps skipped steps in a row; the last checkpoint is not touched."""
        state, limit = self.state, self.tc.max_bad_steps
        if state.bad_steps < limit:
            return
        kept = "no checkpoint was written" if self.saved_step is None else \
            f"the checkpoint at step {self.saved_step} is kept"
        raise QkvError(f"{limit} non-finite steps in a row (steps {state.step - limit + 1}-{state.step}); "
                       f"stopping, {kept}. Lower train.lr, set train.grad_clip or use train.precision=bf16/fp32")

    def track_spike(self, loss: float) -> None:
        """Report a loss above spike_factor x the running median of the last spike_window losses."""
        state, tc = self.state, self.tc
        if not math.isfinite(loss):
            return
        if is_spike(loss, state.recent_losses, tc.spike_factor):
            state.spikes += 1
            median = statistics.median(state.recent_losses)
            self.log(f"qkv: step {state.step}: loss spike {loss:.4f} (> {tc.spike_factor:g} x the running "
                     f"median {median:.4f} of the last {len(state.recent_losses)} losses)")
        state.recent_losses = (state.recent_losses + [loss])[-tc.spike_window:]

    # ---- the loop ----------------------------------------------------------------------------
    def run(self) -> dict:
        """Train to the horizon (or max_time); a first Ctrl-C finishes the step, saves and raises
        KeyboardInterrupt; train.max_bad_steps skipped steps in a row raise QkvError. Returns the summary."""
        tc, state = self.tc, self.state
        logs = open_logs(self.run_dir, state.step, tc.tensorboard, self.log) if self.layout.is_main else []
        bar = tqdm(total=self.bar_total(), initial=state.step, disable=not self.progress, unit="step",
                   dynamic_ncols=True, leave=False)
        self.clock = Clock(state.elapsed)
        self.model.train()
        try:
            with DeferredInterrupt(self.log) as interrupt:
                while state.step < state.horizon and not self.layout.any(interrupt.requested):
                    self.train_one(logs, bar)
                    if tc.max_time and state.elapsed >= tc.max_time:
                        break
                if self.layout.any(interrupt.requested):  # the step is complete: a consistent state to save
                    self.save()
                    raise KeyboardInterrupt
                final_val = self.evaluate()
                self.write(logs, step=state.step, val_loss=final_val, elapsed_s=state.elapsed)
                self.save()
        finally:
            bar.close()
            for log in logs[1:]:
                log.close()
        return {"steps": state.step, "tokens": state.tokens, "seconds": round(state.elapsed, 2),
                "tokens_per_s": round(state.tokens / max(1e-9, state.elapsed)),
                "val_loss": finite_or_none(final_val), "best_val_loss": finite_or_none(state.best_val),
                "skipped_steps": state.skipped, "spikes": state.spikes,
                **self.utilisation(state.tokens / max(1e-9, state.elapsed))}

    def utilisation(self, tokens_per_s: float) -> dict:
        """Achieved model FLOP/s (forward + backward, attention included) and MFU when the peak is known;
        under torchrun the whole job's, against the peak of all its devices."""
        achieved = tokens_per_s * self.flops_per_token
        peak = self.peak_flops * self.layout.world if self.peak_flops else None
        return {"flops_per_s": achieved, "mfu": achieved / peak if peak else None}

    def train_one(self, logs: list, bar) -> None:
        """One step of the loop: the update, then its bookkeeping (log row, evaluation, checkpoint)."""
        tc, state, clock = self.tc, self.state, self.clock
        rows = self.rows(state.step)
        batch = [torch.from_numpy(self.layout.shard(a[:rows])).to(self.device) for a in self.batches.next()]
        lr = self.lr(state.step, rows)
        result = self.step(*batch, lr=lr)
        state.step += 1
        state.tokens += rows * tc.seq_len
        clock.tokens += rows * tc.seq_len
        state.elapsed = self.layout.from_main(clock.elapsed())  # one clock: every rank stops at the same step
        spikes = state.spikes
        if not result.skipped:
            self.track_spike(result.loss)
        self.fit_horizon(clock)
        val = math.nan
        if tc.eval_every and state.step % tc.eval_every == 0 and state.step < state.horizon:
            val = self.evaluate()
        if (state.step % tc.log_every == 0 or state.step == state.horizon or not math.isnan(val)
                or result.skipped or state.spikes > spikes):
            rate = clock.rate()
            self.write(logs, step=state.step, loss=result.loss, val_loss=val, lr=lr, grad_norm=result.grad_norm,
                       tokens_per_s=rate, elapsed_s=state.elapsed, batch_size=rows, aux_loss=result.aux_loss,
                       **self.utilisation(rate))
            bar.set_postfix(loss=f"{result.loss:.3f}", lr=f"{lr:.2e}", tok_s=f"{rate:,.0f}", refresh=False)
        self.check_bad_steps()
        bar.total = self.bar_total()
        bar.update(1)
        # never over the last good checkpoint while steps are being skipped: those weights may hold the NaN
        if (tc.checkpoint_every and state.step % tc.checkpoint_every == 0 and state.step < state.horizon
                and not state.bad_steps):
            self.save()

    def bar_total(self) -> int | None:
        """The progress bar's length: unknown (a plain counter) until a time budget's horizon is first fitted."""
        tc = self.tc
        unfitted = tc.max_time and tc.time_horizon and self.state.horizon == tc.max_steps
        return None if unfitted else self.state.horizon

    def write(self, logs: list, **row) -> None:
        """One row in metrics.csv (and TensorBoard), with the run's counters."""
        row.update(skipped=self.state.skipped, spikes=self.state.spikes,
                   loss_scale=self.scaler.get_scale() if self.scaler.is_enabled() else None)
        for log in logs:
            log.write(**row)

    def evaluate(self) -> float:
        tc = self.tc
        if self.pipeline:  # every rank evaluates the whole model, with each stage's current weights
            self.pipeline.sync()
        loss = objectives.evaluate(self.objective, self.model, self.data.val, self.data.tokenizer, self.cfg,
                                   batch_size=max(1, tc.batch_size // tc.accumulation), batches=tc.eval_batches,
                                   seed=tc.seed + 1, device=self.device)
        self.state.best_val = min(self.state.best_val, loss)
        return loss

    def fit_horizon(self, clock: "Clock") -> None:
        """With max_time, re-estimate how many steps fit and stretch the LR schedule to end there. Each estimate
        uses the speed since the previous one (the first: since the run began), so a slow start (a machine
        that was busy, warm-up) does not cut the run short once the steps get faster."""
        tc, state = self.tc, self.state
        if not (tc.max_time and tc.time_horizon) or not clock.checks or state.elapsed < clock.checks[0] * tc.max_time:
            return
        since_elapsed, since_step = clock.fitted
        seconds_per_step = (state.elapsed - since_elapsed) / max(1, state.step - since_step)
        remaining = max(0.0, tc.max_time - state.elapsed)
        state.horizon = min(tc.max_steps, state.step + max(1, int(remaining / max(1e-9, seconds_per_step))))
        clock.fitted = (state.elapsed, state.step)
        clock.checks = [c for c in clock.checks if state.elapsed < c * tc.max_time]


class Clock:
    """Training seconds over all sessions, and the throughput since the last logged row."""

    def __init__(self, elapsed_before: float):
        self.elapsed_before, self.session_start = elapsed_before, time.perf_counter()
        self.window_start, self.tokens = time.perf_counter(), 0
        self.checks = list(HORIZON_CHECKS)  # fractions of max_time still to fit the step horizon at
        self.fitted = (0.0, 0)  # (elapsed, step) of the last fit; the first fit averages the whole run

    def elapsed(self) -> float:
        return self.elapsed_before + time.perf_counter() - self.session_start

    def rate(self) -> float:
        """Tokens per second since the previous call; starts a new window."""
        now = time.perf_counter()
        rate = self.tokens / max(1e-9, now - self.window_start)
        self.window_start, self.tokens = now, 0
        return rate


def finite_or_none(value: float) -> float | None:
    """JSON has no NaN or Infinity: a value that is not finite is reported as null."""
    return value if math.isfinite(value) else None


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
