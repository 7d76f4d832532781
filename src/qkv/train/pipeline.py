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
the full gradient and takes the same update. Model code stays single-device: every rank builds the whole
model and runs the blocks of its stage; `sync` copies each stage's parameters (and optimizer state) to
the other ranks before the whole model is saved or evaluated.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh

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
        ("model.moe_experts", model.moe_experts, 0), ("train.accumulation", tc.accumulation, 1),
        ("train.batch_warmup_steps", tc.batch_warmup_steps, 0)) if value != off]
    if tc.precision == "fp16":
        unsupported.append(("train.precision", "fp16"))
    if unsupported:
        name, value = unsupported[0]
        hint = " (micro-batches are parallel.microbatches)" if name == "train.accumulation" else ""
        raise QkvError(f"parallel.pp={pc.pp} does not support {name}={value!r}{hint}")
    rows = tc.batch_size // dp
    if pc.microbatches < pc.pp or rows % pc.microbatches:
        raise QkvError(f"parallel.microbatches={pc.microbatches} must be at least parallel.pp={pc.pp} and divide "
                       f"the {rows} rows of a batch on each pipeline (train.batch_size / parallel.dp)")


def stage_layers(n_layers: int, stages: int) -> list[range]:
    """Contiguous blocks per stage, sizes differing by at most one (earlier stages get the extra ones)."""
    bounds = [round(s * n_layers / stages) for s in range(stages + 1)]
    return [range(bounds[s], bounds[s + 1]) for s in range(stages)]


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

    `wrap` (e.g. data parallel) is applied to the stage module before the pipeline stage is built."""

    def __init__(self, model: nn.Module, pp_mesh: DeviceMesh, cfg: RunConfig, device: torch.device,
                 *, dp: int = 1, wrap=lambda module: module):
        validate(cfg, dp)
        pc, tc = cfg.parallel, cfg.train
        self.model, self.group, self.device, self.precision = model, pp_mesh.get_group(), device, tc.precision
        self.stages, self.index = pp_mesh.size(), pp_mesh.get_local_rank()
        self.ranks = dist.get_process_group_ranks(self.group)  # global rank of each stage
        splits = stage_layers(len(model.blocks), self.stages)
        modules = [Stage(model, layers, first=s == 0, last=s == self.stages - 1) for s, layers in enumerate(splits)]
        self.stage_module = modules[self.index]
        # owners[i]: the stages that use parameter i of the model (named_parameters order, a tied one once)
        holders = [{id(p) for p in module.parameters()} for module in modules]
        self.params = [p for _, p in model.named_parameters()]
        self.owners = [[s for s in range(self.stages) if id(p) in holders[s]] for p in self.params]
        self.shared = [p for p, owners in zip(self.params, self.owners) if len(owners) > 1]
        rows, d_model = tc.batch_size // dp // pc.microbatches, cfg.model.d_model
        shape = (rows, tc.seq_len)
        # the shapes each stage sends and receives, given so that no metadata is exchanged at run time
        # (received activations and sent outputs carry gradients back)
        inputs = torch.empty(shape, dtype=torch.long, device="meta") if self.index == 0 else \
            torch.empty(*shape, d_model, device="meta", requires_grad=True)
        width = cfg.model.vocab_size if self.is_last else d_model
        outputs = torch.empty(*shape, width, device="meta", requires_grad=True)
        from torch.distributed import pipelining  # a second to import: only once a pipeline is built

        self.stage = pipelining.PipelineStage(wrap(self.stage_module), self.index, self.stages, device,
                                   input_args=inputs, output_args=outputs, group=self.group)
        smoothing = tc.label_smoothing
        self.schedule = getattr(pipelining, SCHEDULES.get(pc.schedule))(
            self.stage, n_microbatches=pc.microbatches,
            loss_fn=lambda logits, targets: cross_entropy(logits, targets, smoothing))  # each micro-batch's mean

    @property
    def is_last(self) -> bool:
        return self.index == self.stages - 1

    def named_parameters(self):
        """(name in the whole model, parameter) for this stage's parameters."""
        mine = {id(p) for p in self.stage_module.parameters()}
        return [(name, p) for name, p in self.model.named_parameters() if id(p) in mine]

    def forward_backward(self, batch: tuple[Tensor, Tensor], backward=None) -> tuple[Tensor, Tensor]:
        """The step runner's method (qkv.train.steps): the schedule runs parallel.microbatches micro-batches
        itself (`backward` is not used). Returns (the batch-mean loss on every stage, aux 0)."""
        with autocast(self.device, self.precision):
            loss = self.run_schedule(*batch)
        return loss, torch.zeros((), device=self.device)

    def run_schedule(self, inputs: Tensor, targets: Tensor) -> Tensor:
        """Run the schedule over one batch: gradients of the batch-mean loss on this stage's parameters
        (shared ones summed over the stages). Returns the batch-mean loss on every stage. Collective."""
        losses: list[Tensor] = []
        if self.index == 0:
            self.schedule.step(inputs, target=targets if self.is_last else None, losses=losses)
        elif self.is_last:
            self.schedule.step(target=targets, losses=losses)
        else:
            self.schedule.step()
        self.sum_shared_grads()
        loss = torch.stack(losses).mean().detach() if self.is_last else torch.zeros((), device=inputs.device)
        dist.broadcast(loss, src=self.ranks[-1], group=self.group)
        return loss

    def sum_shared_grads(self) -> None:
        """g_shared = sum over stages of each stage's gradient (zero where a stage did not use it)."""
        for param in self.shared:
            if param.grad is None:
                param.grad = torch.zeros_like(param)
            dist.all_reduce(local(param.grad), group=self.group)

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

    @torch.no_grad()
    def sync(self, optimizer: torch.optim.Optimizer | None = None) -> None:
        """Copy every parameter (and its optimizer state) from its first stage to the other ranks, so each
        rank's whole model equals the trained one (before a save or an evaluation). Collective."""
        for param, owners in zip(self.params, self.owners):
            source = self.ranks[owners[0]]
            dist.broadcast(local(param), src=source, group=self.group)
            if optimizer is not None:
                self.sync_state(optimizer.state[param], param, source, owned=self.index == owners[0])

    def sync_state(self, state: dict, param: Tensor, source: int, *, owned: bool) -> None:
        """One parameter's optimizer state from `source`: which of STATE_KEYS it has, then each tensor."""
        present = torch.tensor([key in state for key in STATE_KEYS] if owned else [False] * len(STATE_KEYS),
                               device=self.device)
        dist.broadcast(present, src=source, group=self.group)
        for key, there in zip(STATE_KEYS, present.tolist()):
            if not there:
                continue
            if not owned:  # AdamW's step is a float32 scalar; moments and momentum have the parameter's shape
                state[key] = torch.zeros((), dtype=torch.float32) if key == "step" else torch.zeros_like(param)
            value = local(state[key])
            on_device = value.to(self.device)  # a CPU step counter cannot go through NCCL
            dist.broadcast(on_device, src=source, group=self.group)
            value.copy_(on_device)


# the per-parameter state tensors of qkv's optimizers (qkv.train.optim: AdamW, Adam, SGD)
STATE_KEYS = ("step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer")


def local(tensor: Tensor) -> Tensor:
    """The rank's own data of a (possibly DTensor) tensor, for point-to-point collectives."""
    return tensor.to_local() if is_dtensor(tensor) else tensor
