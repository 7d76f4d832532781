"""The training loop: cross-entropy, AdamW, schedule, clipping, accumulation, evaluation, checkpoints.

One optimizer step (note 000 LLM §4-§6, §10.2, §10.4), over the b = rows(step) rows of the batch split
into micro-batches of batch_size / accumulation rows (b_i rows each):
    L_i = CE_i + alpha * aux_i [+ beta * z_i]   (aux: the MoE balance loss, LLM §6.3; alpha train.aux_loss_weight;
                                                z: the router z-loss, beta train.router_z_loss_weight)
    g = sum_i (b_i / b) grad L_i                (accumulation: exactly the gradient of the whole batch)
    g <- g * min(1, c / ||g||_2)                (global-norm clipping, LLM §4.3)
    theta <- AdamW(theta, g, lr(step))          (LLM §4.1, decoupled decay), unless g or the loss is not finite
fp16 multiplies the loss by a dynamic scale S before the backward and divides the gradients by S (LLM §6.2
"损失缩放"; torch's GradScaler): an overflow skips the update and halves S, loss_scale_window good steps in
a row double it. The weights and the optimizer stay fp32 (master weights); autocast runs the matmuls in
the low precision while softmax, norms and the loss compute in fp32 inside the model.

The Trainer holds the run together; each concern lives beside its kind: the layout's forward and backward
in its step runner (qkv.train.steps, qkv.parallel.pipeline), the state, RNG and the resume / save of the
checkpoint set in qkv.train.checkpoint, the skip / stop / spike checks in qkv.train.guards, the learning rate, the batch rows,
the clock and the time-budget horizon in qkv.schedules, the report in qkv.cli.
"""
from __future__ import annotations

import contextlib
import math
from pathlib import Path
from typing import Callable, NamedTuple

import torch
from tqdm import tqdm

from qkv import files, schedules
from qkv.analysis import flops
from qkv.config import RunConfig, TrainConfig
from qkv.data.dataset import Prepared
from qkv.models import build_model
from qkv.nn.linear_cross_entropy import vocab_parallel_loss
from qkv.nn.lora import lora_model, parse_spec
from qkv.nn.moe import MoE, aux_loss, nudge_choice_bias, z_loss
from qkv.train import checkpoint, objectives
from qkv.parallel import layout as parallel
from qkv.train.checkpoint import State, seed_everything
from qkv.train.guards import DeferredInterrupt, StepGuards
from qkv.train.metrics import open_logs
from qkv.train.optim import OPTIMIZERS
from qkv.parallel import precision
from qkv.parallel.precision import autocast
from qkv.train.steps import runner_for


def trainable_model(cfg: RunConfig, base: torch.nn.Module | None = None) -> torch.nn.Module:
    """The model a run trains: `base` (the --init model itself, when it is exactly this config's model: no second
    copy is built) or its config's model, with LoRA adapters over the frozen layers when train.lora is set
    (qkv.nn.lora; QLoRA quantizes the layers it is given)."""
    model = base if base is not None else build_model(cfg.model)
    for param in model.parameters():
        param.requires_grad_(True)
    if cfg.train.lora:
        lora_model(model, parse_spec(cfg.train.lora))
    return model


class StepResult(NamedTuple):
    loss: float  # mean cross-entropy over the batch (the aux loss is not in it)
    grad_norm: float  # global L2 norm before clipping
    skipped: bool  # not finite: no update
    aux_loss: float = math.nan  # mean MoE balance loss (nan without MoE)
    extras: dict | None = None  # what the objective recorded (DPO's rewards), batch means


class Trainer:
    def __init__(self, run_dir: Path, cfg: RunConfig, data: Prepared, *, progress: bool = True,
                 log: Callable[[str], None] = print, layout: parallel.Layout | None = None,
                 model: torch.nn.Module | None = None):
        self.run_dir, self.cfg, self.data = Path(run_dir), cfg, data
        self.tc: TrainConfig = cfg.train
        # under torchrun: this rank's place (rank 0 alone logs, shows progress and writes the run dir)
        self.layout = layout or parallel.setup(cfg, parallel.resolve_device(self.tc.device))
        self.log = log if self.layout.is_main else (lambda message: None)
        self.progress = progress and self.layout.is_main
        self.device = self.layout.device
        self.cfg, _ = precision.resolved(cfg, self.device)  # train.precision=auto (qkv.train.job.start says it)
        cfg = self.cfg
        self.tc = cfg.train
        if self.tc.threads:
            torch.set_num_threads(self.tc.threads)
        seed_everything(self.tc.seed)
        # fp32 weights in every precision (master weights); `model`: the --init model, taken as it is
        self.model = trainable_model(cfg, model).to(self.device)
        self.flops_per_token = flops.train_flops_per_token(cfg.model, self.tc.seq_len)  # for MFU (qkv calc)
        self.peak_flops = self.tc.peak_flops or (flops.peak_flops_for(torch.cuda.get_device_name(self.device))
                                                 if self.device.type == "cuda" else None)
        self.autocast = lambda: autocast(self.device, self.tc.precision)  # the training forward's precision
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=self.tc.precision == "fp16",
                                           growth_interval=self.tc.loss_scale_window)
        # wraps the model (or its stage) from outside; a pipeline stage keeps only its own parameters
        self.runner = runner_for(self.model, cfg, self.layout, self.scaler)
        self.has_moe = any(isinstance(module, MoE) for module in self.model.modules())
        optimizer = OPTIMIZERS.get(self.tc.optimizer)(self.model, self.tc)  # after FSDP2: over its shards
        self.optimizer = parallel.shard_optimizer(optimizer, self.layout)  # zero=1
        self.objective = objectives.for_run(cfg)  # lm, mlm or seq2seq: its batches and its loss
        self.batches = self.objective.batches(data.train, data.tokenizer, cfg, batch_size=self.tc.batch_size,
                                              seed=self.tc.seed)
        self.objective.batches(data.val, data.tokenizer, cfg, batch_size=1, seed=0)  # fail now, not at eval
        self.state = State(horizon=self.tc.max_steps)
        self.guards = StepGuards(self.tc, lambda message: self.log(message))  # self.log as it is then
        self.checkpoints = checkpoint.Checkpoints(self.model, self.optimizer, self.scaler, self.batches, self.layout,
                                                  self.runner, lambda message: self.log(message))
        self.saved_step: int | None = None  # the step of the last complete checkpoint, None before one

    # ---- state -------------------------------------------------------------------------------
    def resume(self) -> bool:
        """Load the last complete checkpoint; False when the run has none yet."""
        state = self.checkpoints.resume(self.run_dir, self.tc)
        if state is None:
            return False
        self.state, self.saved_step = state, state.step
        return True

    def save(self) -> None:
        self.checkpoints.save(self.run_dir, self.state)
        self.saved_step = self.state.step

    def gather(self) -> None:
        """End a distributed run: rank 0 swaps in a plain single-device model holding the full weights (for
        the summary and the sample), then every rank leaves the process group. Collective."""
        if not self.layout.distributed:
            return
        weights = self.runner.full_weights()
        if self.layout.is_main:
            self.model = trainable_model(self.cfg).to(self.device)
            files.load_model_tensors(self.model, weights, "the gathered weights")
        parallel.shutdown()

    # ---- one step ----------------------------------------------------------------------------
    def lr(self, step: int, rows: int | None = None) -> float:
        return schedules.learning_rate(self.tc, step, horizon=self.state.horizon, d_model=self.cfg.model.d_model,
                                       rows=rows)

    def step(self, *batch: torch.Tensor, lr: float) -> StepResult:
        """One optimizer update over `batch` (the objective's tensors, e.g. inputs and targets, b rows each;
        b / dp on each rank under data parallel) in the runner's micro-batches."""
        for group in self.optimizer.param_groups:  # a group may run at a multiple of it (Muon's matrices)
            group["lr"] = lr * group.get("lr_scale", 1.0)
        # under data parallel `batch` is this rank's b / dp rows; DDP / FSDP2 average the gradients over
        # the ranks (note 000 LLM §7.1), which makes g the gradient of the global batch
        recorder = self.objective.recorder
        if recorder is not None:
            recorder.take()  # drop what an evaluation recorded
        total, aux_total = self.runner.forward_backward(batch, self.backward)
        total, aux_total = self.layout.dp_mean(total), self.layout.dp_mean(aux_total)  # global batch means
        extras = {} if recorder is None else {name: self.layout.dp_mean(value).item()
                                               for name, value in recorder.take().items()}
        self.scaler.unscale_(self.optimizer)  # fp16: g / S, recording whether any is inf or NaN
        norm = self.runner.clip(self.tc.grad_clip if self.tc.grad_clip > 0 else math.inf)  # over every shard
        loss_value, norm_value = total.item(), norm.item()
        skipped = not (math.isfinite(loss_value) and math.isfinite(norm_value))
        if not skipped:
            self.scaler.step(self.optimizer)
            if self.tc.moe_bias_rate:  # DeepSeek-V3's balancing: the choosing bias follows the step's load
                nudge_choice_bias(self.model, self.tc.moe_bias_rate, reduce=self.layout.dp_mean)
        self.scaler.update()  # fp16: halve S after an overflow, double it after loss_scale_window good steps
        self.optimizer.zero_grad(set_to_none=True)
        self.guards.count_skip(self.state, skipped, loss_value, norm_value,
                               self.scaler.get_scale() if self.scaler.is_enabled() else None)
        return StepResult(loss_value, norm_value, skipped, aux_total.item() if self.has_moe else math.nan, extras)

    def backward(self, module: torch.nn.Module, micro: tuple[torch.Tensor, ...],
                 share: float) -> tuple[torch.Tensor, torch.Tensor]:
        """Forward (through `module`, the wrapped model) and backward of one micro-batch, its gradient weighted
        by `share`; returns (loss, aux) detached."""
        with self.loss_context():
            with autocast(self.device, self.tc.precision):
                loss = self.objective.loss(module, micro, self.tc.label_smoothing)
            objective, aux = loss, torch.zeros((), device=self.device)
            if self.has_moe:  # B8: + alpha * the balance loss of this forward (note 000 LLM §6.3)
                aux = aux_loss(self.model)
                objective = loss + self.tc.aux_loss_weight * aux
                if self.tc.router_z_loss_weight:  # + the router z-loss (ST-MoE; qkv.nn.moe)
                    objective = objective + self.tc.router_z_loss_weight * z_loss(self.model)
            self.scaler.scale(objective * share).backward()
        return loss.detach(), aux.detach()

    def loss_context(self):
        """Tensor parallel: the vocabulary-parallel loss, whose backward runs inside it too."""
        return vocab_parallel_loss() if self.layout.tp > 1 else contextlib.nullcontext()

    # ---- the loop ----------------------------------------------------------------------------
    def run(self) -> dict:
        """Train to the horizon (or max_time); a first Ctrl-C finishes the step, saves and raises
        KeyboardInterrupt; train.max_bad_steps skipped steps in a row raise QkvError. Returns the summary."""
        tc, state = self.tc, self.state
        logs = open_logs(self.run_dir, state.step, tc.tensorboard, self.log) if self.layout.is_main else []
        bar = tqdm(total=schedules.known_horizon(tc, state.horizon), initial=state.step, disable=not self.progress,
                   unit="step", dynamic_ncols=True, leave=False)
        self.clock = schedules.Clock(state.elapsed)
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
                **self.utilisation(state.tokens / max(1e-9, state.elapsed)), **self.device_memory()}

    def device_memory(self) -> dict:
        """On a GPU, the most memory torch's allocator held for tensors at once in this process (MB)."""
        if self.device.type != "cuda":
            return {}
        return {"peak_gpu_memory_mb": round(torch.cuda.max_memory_allocated(self.device) / 2 ** 20)}

    def utilisation(self, tokens_per_s: float) -> dict:
        """Achieved model FLOP/s (forward + backward, attention included) and MFU when the peak is known;
        under torchrun the whole job's, against the peak of all its devices."""
        achieved = tokens_per_s * self.flops_per_token
        peak = self.peak_flops * self.layout.world if self.peak_flops else None
        return {"flops_per_s": achieved, "mfu": achieved / peak if peak else None}

    def train_one(self, logs: list, bar) -> None:
        """One step of the loop: the update, then its bookkeeping (log row, evaluation, checkpoint)."""
        tc, state, clock = self.tc, self.state, self.clock
        rows, cols = schedules.step_rows(tc, state.step, self.layout.dp), schedules.step_cols(tc, state.step)
        arrays = [a[:rows] if cols == tc.seq_len else a[:rows, :cols] for a in self.batches.next()]  # (rows, cols)
        batch = [torch.from_numpy(self.layout.shard(a)).to(self.device) for a in arrays]
        lr = self.lr(state.step, rows)
        result = self.step(*batch, lr=lr)
        state.step += 1
        state.tokens += rows * cols
        clock.tokens += rows * cols
        state.elapsed = self.layout.from_main(clock.elapsed())  # one clock: every rank stops at the same step
        spikes = state.spikes
        if not result.skipped:
            self.guards.track_spike(state, result.loss)
        state.horizon = schedules.fit_horizon(tc, state.step, state.elapsed, state.horizon, clock)
        val = math.nan
        if tc.eval_every and state.step % tc.eval_every == 0 and state.step < state.horizon:
            val = self.evaluate()
        if (state.step % tc.log_every == 0 or state.step == state.horizon or not math.isnan(val)
                or result.skipped or state.spikes > spikes):
            rate = clock.rate()
            self.write(logs, step=state.step, loss=result.loss, val_loss=val, lr=lr, grad_norm=result.grad_norm,
                       tokens_per_s=rate, elapsed_s=state.elapsed, batch_size=rows, seq_len=cols,
                       aux_loss=result.aux_loss, **self.utilisation(rate), **(result.extras or {}))
            bar.set_postfix(loss=f"{result.loss:.3f}", lr=f"{lr:.2e}", tok_s=f"{rate:,.0f}", refresh=False)
        self.guards.check_bad_steps(state, self.saved_step)
        bar.total = schedules.known_horizon(tc, state.horizon)
        bar.update(1)
        # never over the last good checkpoint while steps are being skipped: those weights may hold the NaN
        if (tc.checkpoint_every and state.step % tc.checkpoint_every == 0 and state.step < state.horizon
                and not state.bad_steps):
            self.save()

    def write(self, logs: list, **row) -> None:
        """One row in metrics.csv (and TensorBoard), with the run's counters."""
        row.update(skipped=self.state.skipped, spikes=self.state.spikes,
                   loss_scale=self.scaler.get_scale() if self.scaler.is_enabled() else None)
        for log in logs:
            log.write(**row)

    def evaluate(self) -> float:
        tc = self.tc
        model, loss_fn = self.runner.evaluator()  # the model, or a pipeline's stages in turn
        loss = objectives.evaluate(self.objective, model, self.data.val, self.data.tokenizer, self.cfg,
                                   batch_size=max(1, tc.batch_size // tc.accumulation), batches=tc.eval_batches,
                                   seed=tc.seed + 1, device=self.device, loss=loss_fn)
        self.state.best_val = min(self.state.best_val, loss)
        return loss


def finite_or_none(value: float) -> float | None:
    """JSON has no NaN or Infinity: a value that is not finite is reported as null."""
    return value if math.isfinite(value) else None
