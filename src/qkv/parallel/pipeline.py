"""Pipeline parallel for qkv's decoder (SPEC C4; note 000 LLM §7.2
"将模型层分配到不同GPU，微批次流水线执行": layers assigned to devices, micro-batches run as a pipeline).

The L blocks are split into p = parallel.pp contiguous stages, one per rank of the pp mesh dimension: the
first stage also embeds (W_E, positions, embedding dropout), the last also holds the final norm, the LM
head and the loss. A batch of b rows is cut into m = parallel.microbatches micro-batches of b/m rows that
flow through the stages under torch.distributed.pipelining's schedules:

    gpipe  every micro-batch forward, then every backward: activations of m micro-batches in flight per stage,
           idle share (bubble) (p - 1) / (m + p - 1) of each stage's time;
    1f1b   after p - s warm-up forwards stage s alternates one forward, one backward: at most p micro-batches
           in flight, the same bubble.

Each micro-batch's loss is its mean cross-entropy and the schedule scales the gradients by 1/m, so the
gradient is that of the batch mean, as in one process (equal micro-batches, no ignored targets).

A parameter used by several stages (W_E with tied embeddings: the embedding on the first stage and the
head on the last; a positional module whose parameters every layer reads) gets each stage's gradient
summed over the pp ranks after the backward (Megatron's tied-embedding all-reduce), so every copy sees
the full gradient and takes the same update.

Memory is split: model code stays single-device (every rank builds the whole model with the same seed, so
each stage starts from one process's weights), then every parameter outside this rank's stage is replaced by
a meta tensor (shape, no storage). The optimizer holds the whole model's parameters in one process's order
but only this stage's have gradients, so only they ever get moments. A checkpoint gathers each parameter
and moment from its stage onto rank 0 (point to point), which writes one process's files; a resume in any
layout reads them and keeps its stage's share. Evaluation runs the stages one after the other on each batch.

Gradient accumulation runs the schedule train.accumulation times per step, each on batch / accumulation
rows; each micro-batch's loss is weighted by 1 / (m * accumulation) and the schedule does not rescale, so
the gradient is that of the batch mean. fp16 scales that loss by the GradScaler's S; an overflow on one
stage is an overflow of the step: every stage then sees an inf and skips with it.
"""
from __future__ import annotations

import math
from typing import Callable

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh

from qkv import files
from qkv.analysis.params import stage_layers  # the split, shared with the calculator
from qkv.config import RunConfig
from qkv.errors import QkvError
from qkv.nn.fastpath import is_dtensor
from qkv.nn.linear_cross_entropy import cross_entropy
from qkv.registry import Registry
from qkv.parallel.precision import autocast
from qkv.parallel.stages import STATE_KEYS, Stage, StagedForward, load_resident_optimizer, release, retie
from qkv.files import optimizer_tensors

# parallel.schedule -> its class in torch.distributed.pipelining (imported when a pipeline is built: the
# package takes over a second to import, and a config check only needs the names)
PIPELINE_SCHEDULES: Registry[str] = Registry("pipeline schedule")
PIPELINE_SCHEDULES.register("gpipe")("ScheduleGPipe")
PIPELINE_SCHEDULES.register("1f1b")("Schedule1F1B")


def validate(cfg: RunConfig, dp: int = 1) -> None:
    """QkvError unless cfg.model can run as parallel.pp stages of parallel.microbatches micro-batches."""
    pc, tc, model = cfg.parallel, cfg.train, cfg.model
    if pc.pp == 1:
        return
    if model.arch != "decoder" or tc.objective not in ("auto", "lm"):
        raise QkvError(f"parallel.pp={pc.pp}: pipeline parallel supports the decoder LM only "
                       f"(model.arch='decoder', train.objective='lm'), not {model.arch!r} / {tc.objective!r}")
    if pc.pp > model.n_layers:
        raise QkvError(f"parallel.pp={pc.pp} is larger than model.n_layers={model.n_layers}: each stage needs a layer")
    if pc.zero == 1:
        raise QkvError(f"parallel.pp={pc.pp} with parallel.zero=1: shard a pipeline's data-parallel dimension with "
                       f"parallel.zero=2 or 3 (FSDP2), or keep parallel.zero=0 (DDP)")
    unsupported = [(name, value, off) for name, value, off in (
        ("model.moe_experts", model.moe_experts, 0), ("train.batch_warmup_steps", tc.batch_warmup_steps, 0),
        ("train.seq_warmup_steps", tc.seq_warmup_steps, 0))
        if value != off]
    if unsupported:
        name, value, off = unsupported[0]
        raise QkvError(f"parallel.pp={pc.pp} does not support {name}={value!r} (set {name}={off!r})")
    rows = tc.batch_size // dp // tc.accumulation
    if pc.microbatches < pc.pp or rows % pc.microbatches:
        raise QkvError(f"parallel.microbatches={pc.microbatches} must be at least parallel.pp={pc.pp} and divide "
                       f"the {rows} rows of a schedule's batch on each pipeline "
                       f"(train.batch_size / parallel.dp / train.accumulation)")


class Pipeline:
    """This rank's stage of `model` on the pp dimension of a mesh, and the schedule that trains it.

    `model` may already be split by tensor parallel (DTensor parameters); `wrap` (data parallel: DDP, or
    FSDP2 for zero 2 / 3) is applied to the stage module before the pipeline stage is built; `scaler` is the
    run's GradScaler (fp16 scales each micro-batch's loss by it). `tp` is the tensor-parallel size."""

    def __init__(self, model: nn.Module, pp_mesh: DeviceMesh, cfg: RunConfig, device: torch.device,
                 *, dp: int = 1, tp: int = 1, wrap=lambda module: module, scaler: torch.amp.GradScaler | None = None):
        validate(cfg, dp)
        pc, tc = cfg.parallel, cfg.train
        self.model, self.group, self.device, self.precision = model, pp_mesh.get_group(), device, tc.precision
        self.scaler, self.accumulation, self.smoothing = scaler, tc.accumulation, tc.label_smoothing
        if scaler is not None and scaler.is_enabled():  # S is made at its first use: on the last stage only
            scaler.scale(torch.zeros((), device=device))  # so every stage's scaler starts with it now
        self.stages, self.index = pp_mesh.size(), pp_mesh.get_local_rank()
        self.ranks = dist.get_process_group_ranks(self.group)  # global rank of each stage
        self.main = self.ranks[0] == 0  # rank 0's pipeline: its stages send to rank 0 (at dp 0, tp 0)
        splits = stage_layers(len(model.blocks), self.stages)
        modules = [Stage(model, layers, first=s == 0, last=s == self.stages - 1, tokens=tc.seq_len)
                   for s, layers in enumerate(splits)]
        self.stage_module = modules[self.index]
        # owners[i]: the stages that use parameter i of the model (named_parameters order, a tied one once)
        holders = [{id(p) for p in module.parameters()} for module in modules]
        self.owners = [[s for s in range(self.stages) if id(p) in holders[s]] for p in model.parameters()]
        release(model, holders[self.index])  # the other stages' parameters: meta tensors, no storage
        self.d_model, self.vocab_size, self.tp = cfg.model.d_model, cfg.model.vocab_size, tp
        self.shared_groups = self.owner_groups()
        rows = tc.batch_size // dp // tc.accumulation // pc.microbatches
        # the shapes each stage sends and receives, given so that no metadata is exchanged at run time
        # (received activations and sent outputs carry gradients back); tp splits the stream over T
        inputs = torch.empty(rows, tc.seq_len, dtype=torch.long, device="meta") if self.index == 0 else \
            torch.empty(rows, self.local_tokens(tc.seq_len), self.d_model, device="meta", requires_grad=True)
        outputs = torch.empty(rows, tc.seq_len, self.vocab_size, device="meta", requires_grad=True) if self.is_last \
            else torch.empty(rows, self.local_tokens(tc.seq_len), self.d_model, device="meta", requires_grad=True)
        from torch.distributed import pipelining  # a second to import: only once a pipeline is built

        entries = {(id(m), n): p for m in model.modules() for n, p in m._parameters.items() if p is not None}
        wrapped = wrap(self.stage_module)
        retie(model, self.stage_module, entries)  # FSDP2 replaced the stage's parameters: the model's too
        self.stage = pipelining.PipelineStage(wrapped, self.index, self.stages, device,
                                              input_args=inputs, output_args=outputs, group=self.group)
        self.named = list(model.named_parameters())  # after the wrap: FSDP2's sharded parameters
        self.params = [p for _, p in self.named]
        self.weight = 1.0 / (pc.microbatches * tc.accumulation)  # each micro-batch's share of the step
        self.schedule = getattr(pipelining, PIPELINE_SCHEDULES.get(pc.schedule))(
            self.stage, n_microbatches=pc.microbatches, loss_fn=self.micro_loss, scale_grads=False)

    @property
    def is_last(self) -> bool:
        return self.index == self.stages - 1

    def local_tokens(self, tokens: int) -> int:
        """Positions of a (B, T, D) stream this rank holds between blocks: its torch.chunk of T over the tp
        ranks (sequence parallel; tp is the innermost mesh dimension)."""
        size = -(-tokens // self.tp)
        return max(0, min(size, tokens - (dist.get_rank() % self.tp) * size))

    def pipelines(self) -> list[tuple[int, ...]]:
        """Every pipeline's global ranks in stage order, the same list on every rank."""
        mine = torch.tensor(self.ranks, dtype=torch.long, device=self.device)
        every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(every, mine)
        return sorted({tuple(t.tolist()) for t in every})

    def owner_groups(self) -> list:
        """For each shared parameter, the process group of the stages that hold it in this rank's pipeline
        (created alike on every rank, as torch.distributed requires)."""
        groups, pipelines = {}, self.pipelines()
        for owners in sorted({tuple(o) for o in self.owners if len(o) > 1}):
            for ranks in pipelines:
                group = dist.new_group([ranks[s] for s in owners])
                if tuple(ranks) == tuple(self.ranks):
                    groups[owners] = group
        return [(i, groups[tuple(o)]) for i, o in enumerate(self.owners) if len(o) > 1 and self.index in o]

    def named_parameters(self):
        """(name in the whole model, parameter) for this stage's parameters."""
        return [(name, p) for name, p in self.named if not p.is_meta]

    def micro_loss(self, logits: Tensor, targets: Tensor) -> Tensor:
        """One micro-batch's mean cross-entropy times its share 1 / (m * accumulation) (and fp16's S)."""
        loss = cross_entropy(logits, targets, self.smoothing) * self.weight
        return self.scaler.scale(loss) if self.scaler is not None and self.scaler.is_enabled() else loss

    # ---- the step runner (qkv.train.steps) ---------------------------------------------------------
    def forward_backward(self, batch: tuple[Tensor, Tensor], backward=None) -> tuple[Tensor, Tensor]:
        """train.accumulation schedules of parallel.microbatches micro-batches each (`backward` is not used):
        gradients of the batch-mean loss on this stage's parameters, shared ones summed over the stages.
        Returns (the batch-mean loss on every stage, aux 0). Collective."""
        inputs, targets = batch
        rows = len(inputs) // self.accumulation
        total = torch.zeros((), device=self.device)
        with autocast(self.device, self.precision):
            for part in zip(inputs.split(rows), targets.split(rows)):
                total += self.run_schedule(*part)
        self.sum_shared_grads()
        self.agree_on_overflow()
        if self.scaler is not None and self.scaler.is_enabled():
            total = total / self.scaler.get_scale()
        dist.broadcast(total, src=self.ranks[-1], group=self.group)
        return total, torch.zeros((), device=self.device)

    def run_schedule(self, inputs: Tensor, targets: Tensor) -> Tensor:
        """One schedule over `inputs`; on the last stage the sum of its micro-batches' weighted losses."""
        losses: list[Tensor] = []
        if self.index == 0:
            self.schedule.step(inputs, target=targets if self.is_last else None, losses=losses,
                               return_outputs=False)
        elif self.is_last:
            self.schedule.step(target=targets, losses=losses, return_outputs=False)
        else:
            self.schedule.step(return_outputs=False)
        return torch.stack(losses).sum().detach() if losses else torch.zeros((), device=self.device)

    def sum_shared_grads(self) -> None:
        """g_shared = sum over the stages that hold it of each one's gradient (one all-reduce among them)."""
        for i, group in self.shared_groups:
            param = self.params[i]
            if param.grad is None:
                param.grad = torch.zeros_like(param)
            if is_dtensor(param.grad) and param.grad.placements != param.placements:  # tensor parallel's
                param.grad = param.grad.redistribute(param.device_mesh, param.placements)  # embedding: Replicate
            dist.all_reduce(local(param.grad), group=group)

    def agree_on_overflow(self) -> None:
        """fp16: an inf or NaN in any rank's gradient is an overflow of the step, so every stage's scaler
        must see one (each unscales its own gradients): a rank whose gradients are finite gets an inf."""
        if self.scaler is None or not self.scaler.is_enabled():
            return
        grads = [local(p.grad) for p in self.stage_module.parameters() if p.grad is not None]
        finite = all(bool(torch.isfinite(g).all()) for g in grads)
        bad = torch.tensor(float(not finite), device=self.device)
        dist.all_reduce(bad, op=dist.ReduceOp.MAX)
        if bad.item() and finite and grads:
            grads[0].view(-1)[0] = math.inf

    def clip(self, max_norm: float) -> Tensor:
        """Global-norm clipping (note 000 LLM §4.3) of the whole model's gradient: each stage's sum of squares
        (a shared parameter counted on its first stage only), summed over the stages."""
        counted = [p.grad for p, owners in zip(self.params, self.owners)
                   if owners[0] == self.index and p.grad is not None]
        norm = torch.nn.utils.get_total_norm(counted) if counted else torch.zeros((), device=self.device)
        if is_dtensor(norm):
            norm = norm.full_tensor()
        squares = norm.float() ** 2
        dist.all_reduce(squares, group=self.group)
        total = squares.sqrt()
        grads = [p for p in self.stage_module.parameters() if p.grad is not None]
        torch.nn.utils.clip_grads_with_norm_(grads, max_norm, total)
        return total

    def evaluator(self) -> tuple[nn.Module, Callable]:
        """What evaluation calls: the stages one after the other on each batch, and their loss."""
        staged = StagedForward(self)
        return staged, staged.loss

    # ---- checkpoints: the whole model on rank 0, and back ------------------------------------------
    @torch.no_grad()
    def full_weights(self) -> dict[str, Tensor]:
        """The whole model's tensors as one process's files hold them, on rank 0 ({} elsewhere): each
        parameter gathered on its first stage (a sharded one over its mesh) and sent to rank 0; the
        persistent buffers are rank 0's own. Collective."""
        weights = {}
        for (name, param), owners in zip(self.named, self.owners):
            value = self.to_main(param if self.index == owners[0] else None, owners[0], param.shape, param.dtype)
            if value is not None:
                weights[name] = value.cpu().contiguous()
        return {**weights, **files.persistent_buffers(self.model)} if dist.get_rank() == 0 else {}

    @torch.no_grad()
    def full_state(self, optimizer: torch.optim.Optimizer) -> tuple[dict, dict[str, Tensor], list[dict]]:
        """(weights, optimizer tensors `optim.{i}.{key}`, JSON groups) as one process writes them, on rank 0
        ({}, {}, [] elsewhere): each parameter's moments from its first stage. Collective."""
        weights = self.full_weights()
        position = {id(p): i for i, p in enumerate(self.params)}
        tensors = {}
        for index, param in enumerate(p for group in optimizer.param_groups for p in group["params"]):
            owner = self.owners[position[id(param)]][0]
            state = optimizer.state.get(param, {}) if self.index == owner else {}
            flags = [key in state for key in STATE_KEYS]  # the owner's; rank 0 receives them
            present = torch.tensor([float(flag) for flag in flags], device=self.device)
            received = self.to_main(present if self.index == owner else None, owner, present.shape, present.dtype)
            if dist.get_rank() == 0:
                flags = [bool(flag) for flag in received.tolist()]
            elif self.index != owner:
                continue
            for key, there in zip(STATE_KEYS, flags):
                if there:
                    shape, dtype = ((), torch.float32) if key == "step" else (param.shape, param.dtype)
                    value = self.to_main(state.get(key), owner, shape, dtype)
                    if value is not None:
                        tensors[f"optim.{index}.{key}"] = value.cpu().contiguous()
        if dist.get_rank():
            return {}, {}, []
        return weights, tensors, optimizer_tensors(optimizer)[1]

    def to_main(self, value: Tensor | None, owner: int, shape, dtype) -> Tensor | None:
        """`value` of stage `owner` on global rank 0 (None elsewhere). Every rank of that stage takes part in
        gathering a sharded value; its (dp 0, tp 0) rank sends it, unless it is rank 0 itself."""
        if self.index == owner and value is not None and is_dtensor(value):
            value = value.full_tensor()  # over the stage's dp x tp ranks
        if dist.get_rank() == 0:
            if owner == 0:
                return value
            box = torch.empty(shape, dtype=dtype, device=self.device)
            dist.recv(box, src=self.ranks[owner])
            return box
        if self.index == owner and self.main:
            dist.send(value.to(self.device).contiguous(), dst=0)
        return None

    def load_optimizer(self, optimizer: torch.optim.Optimizer, tensors: dict[str, Tensor], groups: list[dict]) -> None:
        """A single-process optimizer state into this stage (the other stages' dropped)."""
        load_resident_optimizer(optimizer, tensors, groups)


def local(tensor: Tensor) -> Tensor:
    """The rank's own data of a (possibly DTensor) tensor, for point-to-point collectives."""
    return tensor.to_local() if is_dtensor(tensor) else tensor
