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

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh

from qkv import files
from qkv.analysis.params import stage_layers  # the split, shared with the calculator
from qkv.config import RunConfig
from qkv.errors import QkvError
from qkv.models.context import self_context
from qkv.nn.hooks import is_dtensor
from qkv.nn.linear_cross_entropy import cross_entropy
from qkv.nn.positional import Learned, Positional
from qkv.registry import Registry
from qkv.train.precision import autocast

# parallel.schedule -> its class in torch.distributed.pipelining (imported when a pipeline is built: the
# package takes over a second to import, and a config check only needs the names)
SCHEDULES: Registry[str] = Registry("pipeline schedule")
SCHEDULES.register("gpipe")("ScheduleGPipe")
SCHEDULES.register("1f1b")("Schedule1F1B")


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
    if pc.tp > 1 or pc.zero:
        raise QkvError(f"parallel.pp={pc.pp} with parallel.tp={pc.tp}, parallel.zero={pc.zero}: pipeline parallel "
                       f"combines with plain data parallel only (dp x pp, zero=0); tp x pp and ZeRO are not supported")
    unsupported = [(name, value) for name, value, off in (
        ("model.moe_experts", model.moe_experts, 0), ("train.batch_warmup_steps", tc.batch_warmup_steps, 0))
        if value != off]
    if unsupported:
        name, value = unsupported[0]
        raise QkvError(f"parallel.pp={pc.pp} does not support {name}={value!r}")
    rows = tc.batch_size // dp // tc.accumulation
    if pc.microbatches < pc.pp or rows % pc.microbatches:
        raise QkvError(f"parallel.microbatches={pc.microbatches} must be at least parallel.pp={pc.pp} and divide "
                       f"the {rows} rows of a schedule's batch on each pipeline "
                       f"(train.batch_size / parallel.dp / train.accumulation)")


class Stage(nn.Module):
    """Blocks `layers` of a DecoderLM (the same modules, keyed by their index in the model), with the
    embedding when `first` and the final norm and LM head when `last`."""

    def __init__(self, model: nn.Module, layers: range, *, first: bool, last: bool):
        super().__init__()
        self.first, self.last = first, last
        # the positional hooks act in every layer; a learned table serves the embedding only, so later
        # stages take the identity hooks instead (every parameter of a stage gets a gradient, as DDP needs)
        keeps_table = first or not isinstance(model.positional, Learned)
        self.positional = model.positional if keeps_table else Positional()
        self.blocks = nn.ModuleDict({str(i): model.blocks[i] for i in layers})
        if first:
            self.tok_emb, self.dropout = model.tok_emb, model.dropout
            self.embed = model.embed  # the model's embedding equation (qkv.nn.embedding), on these modules
        if last:
            self.final_norm, self.lm_head = model.final_norm, model.lm_head

    def forward(self, x: Tensor) -> Tensor:
        """first: (B, T) ids; else (B, T, D) hidden states. -> (B, T, D), or (B, T, V) fp32 logits on the last."""
        B, T = x.shape[:2]
        # the lm objective has no padding: positions 0..T-1 and the causal mask depend on the shape only
        ids = x if self.first else torch.zeros(B, T, dtype=torch.long, device=x.device)
        ctx = self_context(self.positional, ids, None, None, causal=True)
        if self.first:
            x = self.embed(x, ctx.positions)  # H0 (B, T, D)
        for block in self.blocks.values():
            x = block(x, ctx)
        if self.last:
            x = self.lm_head(self.final_norm(x)).float()  # (B, T, V): the loss reads fp32
        return x


class Pipeline:
    """This rank's stage of `model` on the pp dimension of a mesh, and the schedule that trains it.

    `wrap` (e.g. data parallel) is applied to the stage module before the pipeline stage is built; `scaler`
    is the run's GradScaler (fp16 scales each micro-batch's loss by it)."""

    def __init__(self, model: nn.Module, pp_mesh: DeviceMesh, cfg: RunConfig, device: torch.device,
                 *, dp: int = 1, wrap=lambda module: module, scaler: torch.amp.GradScaler | None = None):
        validate(cfg, dp)
        pc, tc = cfg.parallel, cfg.train
        self.model, self.group, self.device, self.precision = model, pp_mesh.get_group(), device, tc.precision
        self.scaler, self.accumulation, self.smoothing = scaler, tc.accumulation, tc.label_smoothing
        if scaler is not None and scaler.is_enabled():  # S is made at its first use: on the last stage only
            scaler.scale(torch.zeros((), device=device))  # so every stage's scaler starts with it now
        self.stages, self.index = pp_mesh.size(), pp_mesh.get_local_rank()
        self.ranks = dist.get_process_group_ranks(self.group)  # global rank of each stage
        self.gathers = self.ranks[0] == 0  # rank 0's pipeline brings the whole model to rank 0
        splits = stage_layers(len(model.blocks), self.stages)
        modules = [Stage(model, layers, first=s == 0, last=s == self.stages - 1) for s, layers in enumerate(splits)]
        self.stage_module = modules[self.index]
        # owners[i]: the stages that use parameter i of the model (named_parameters order, a tied one once)
        holders = [{id(p) for p in module.parameters()} for module in modules]
        self.owners = [[s for s in range(self.stages) if id(p) in holders[s]] for p in model.parameters()]
        release(model, holders[self.index])  # the other stages' parameters: meta tensors, no storage
        self.named = list(model.named_parameters())
        self.params = [p for _, p in self.named]
        self.shared = [p for p, owners in zip(self.params, self.owners) if len(owners) > 1]
        self.d_model, self.vocab_size = cfg.model.d_model, cfg.model.vocab_size
        rows = tc.batch_size // dp // tc.accumulation // pc.microbatches
        shape = (rows, tc.seq_len)
        # the shapes each stage sends and receives, given so that no metadata is exchanged at run time
        # (received activations and sent outputs carry gradients back)
        inputs = torch.empty(shape, dtype=torch.long, device="meta") if self.index == 0 else \
            torch.empty(*shape, self.d_model, device="meta", requires_grad=True)
        width = self.vocab_size if self.is_last else self.d_model
        outputs = torch.empty(*shape, width, device="meta", requires_grad=True)
        from torch.distributed import pipelining  # a second to import: only once a pipeline is built

        self.stage = pipelining.PipelineStage(wrap(self.stage_module), self.index, self.stages, device,
                                              input_args=inputs, output_args=outputs, group=self.group)
        self.weight = 1.0 / (pc.microbatches * tc.accumulation)  # each micro-batch's share of the step
        self.schedule = getattr(pipelining, SCHEDULES.get(pc.schedule))(
            self.stage, n_microbatches=pc.microbatches, loss_fn=self.micro_loss, scale_grads=False)

    @property
    def is_last(self) -> bool:
        return self.index == self.stages - 1

    def named_parameters(self):
        """(name in the whole model, parameter) for this stage's parameters."""
        mine = {id(p) for p in self.stage_module.parameters()}
        return [(name, p) for name, p in self.named if id(p) in mine]

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
        """g_shared = sum over stages of each stage's gradient (zero where a stage does not hold it: a stage
        between two that share W_E adds a temporary zero tensor)."""
        for param in self.shared:
            if param.is_meta:
                dist.all_reduce(torch.zeros(param.shape, dtype=param.dtype, device=self.device), group=self.group)
                continue
            if param.grad is None:
                param.grad = torch.zeros_like(param)
            dist.all_reduce(local(param.grad), group=self.group)

    def agree_on_overflow(self) -> None:
        """fp16: an inf or NaN in any stage's gradient is an overflow of the step, so every stage's scaler
        must see one (each unscales its own gradients): a stage whose gradients are finite gets an inf."""
        if self.scaler is None or not self.scaler.is_enabled():
            return
        grads = [p.grad for p in self.stage_module.parameters() if p.grad is not None]
        finite = all(bool(torch.isfinite(g).all()) for g in grads)
        bad = torch.tensor(float(not finite), device=self.device)
        dist.all_reduce(bad, op=dist.ReduceOp.MAX, group=self.group)
        if bad.item() and finite and grads:
            local(grads[0]).view(-1)[0] = math.inf

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

    def evaluator(self) -> nn.Module:
        """The module evaluation calls: the stages one after the other on each batch."""
        return StagedForward(self)

    # ---- the whole model on rank 0 -----------------------------------------------------------------
    @torch.no_grad()
    def full_weights(self) -> dict[str, Tensor]:
        """The whole model's tensors as one process's files hold them, on rank 0 ({} elsewhere): each
        parameter from its first stage, the persistent buffers (never released) rank 0's own. Collective
        over rank 0's pipeline."""
        if not self.gathers:
            return {}
        weights = {}
        for (name, param), owners in zip(self.named, self.owners):
            value = self.to_main(None if param.is_meta else param, owners[0], param.shape, param.dtype)
            if value is not None:
                weights[name] = value.cpu().contiguous()
        if self.index:
            return {}
        return {**weights, **files.persistent_buffers(self.model)}

    @torch.no_grad()
    def full_state(self, optimizer: torch.optim.Optimizer) -> tuple[dict, dict[str, Tensor], list[dict]]:
        """(weights, optimizer tensors `optim.{i}.{key}`, JSON groups) as one process writes them, on rank 0
        ({}, {}, [] elsewhere): each parameter's moments from its first stage. Collective."""
        from qkv.train.checkpoint import optimizer_tensors

        weights = self.full_weights()
        if not self.gathers:
            return {}, {}, []
        position = {id(p): i for i, p in enumerate(self.params)}
        tensors = {}
        order = [p for group in optimizer.param_groups for p in group["params"]]
        for index, param in enumerate(order):
            owner = self.owners[position[id(param)]][0]
            state = optimizer.state.get(param, {}) if self.index == owner else {}
            flags = [key in state for key in STATE_KEYS]  # the owner's; rank 0 receives them
            present = torch.tensor([float(flag) for flag in flags], device=self.device)
            received = self.to_main(present, owner, present.shape, present.dtype)
            if self.index == 0:
                flags = [bool(flag) for flag in received.tolist()]
            elif self.index != owner:
                continue
            for key, there in zip(STATE_KEYS, flags):
                if there:
                    shape, dtype = ((), torch.float32) if key == "step" else (param.shape, param.dtype)
                    value = self.to_main(state.get(key), owner, shape, dtype)
                    if value is not None:
                        tensors[f"optim.{index}.{key}"] = value.cpu().contiguous()
        if self.index:
            return {}, {}, []
        return weights, tensors, optimizer_tensors(optimizer)[1]

    def to_main(self, value: Tensor | None, owner: int, shape, dtype) -> Tensor | None:
        """`value` from stage `owner` onto the first stage (global rank 0): the value there, None elsewhere."""
        if owner == 0:
            return value if self.index == 0 else None
        if self.index == owner:
            dist.send(local(value).to(self.device).contiguous(), dst=self.ranks[0])
        elif self.index == 0:
            box = torch.empty(shape, dtype=dtype, device=self.device)
            dist.recv(box, src=self.ranks[owner])
            return box
        return None


class StagedForward(nn.Module):
    """The whole model's loss computed stage after stage on one batch (evaluation: no schedule, no
    gradient). Every rank of the pipeline calls it with the same batch; each gets the loss."""

    def __init__(self, pipeline: Pipeline):
        super().__init__()
        self.pipeline, self.stage = pipeline, pipeline.stage_module

    @torch.no_grad()
    def forward(self, inputs: Tensor, targets: Tensor, label_smoothing: float = 0.0) -> Tensor:
        p = self.pipeline
        x = inputs
        if p.index > 0:  # (B, T, D) from the previous stage
            x = torch.empty(*inputs.shape, p.d_model, device=p.device)
            dist.recv(x, src=p.ranks[p.index - 1])
        x = self.stage(x)
        if p.is_last:
            loss = cross_entropy(x, targets, label_smoothing)
        else:
            dist.send(x.float().contiguous(), dst=p.ranks[p.index + 1])
            loss = torch.zeros((), device=p.device)
        dist.broadcast(loss, src=p.ranks[-1], group=p.group)
        return loss


def release(model: nn.Module, keep: set[int]) -> None:
    """Replace each parameter of `model` whose id is not in `keep` by a meta tensor of its shape (one per
    parameter, so a tied pair stays tied): its storage is freed; names and order are unchanged."""
    meta: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is None or id(param) in keep:
                continue
            if id(param) not in meta:
                meta[id(param)] = nn.Parameter(torch.empty_like(param, device="meta"),
                                               requires_grad=param.requires_grad)
            module._parameters[name] = meta[id(param)]


# the per-parameter state tensors of qkv's optimizers (qkv.train.optim: AdamW, Adam, SGD)
STATE_KEYS = ("step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer")


def local(tensor: Tensor) -> Tensor:
    """The rank's own data of a (possibly DTensor) tensor, for point-to-point collectives."""
    return tensor.to_local() if is_dtensor(tensor) else tensor
