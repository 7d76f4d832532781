"""Expert parallel for qkv's mixture-of-experts layers (SPEC G9; note 002 "混合专家"; GShard, Lepikhin et al.
2020; the all-to-all dispatch of torchtitan's and Megatron's expert parallel).

Data parallel gives each of the K = parallel.dp ranks b / K rows of the batch and a whole model. Expert parallel,
P = parallel.ep dividing K and the expert count E, keeps that for everything but the experts: the K ranks form
K / P groups of P consecutive ranks, and rank p of a group holds experts p E/P .. (p + 1) E/P - 1 of every MoE
layer (their weights, gradients and optimizer moments; the other experts are meta tensors: shape, no storage).
An MoE layer's forward on rank p of a group:

    1. route its own tokens as one process does (the router is replicated): top (N, k), gates (N, k);
    2. sort the kept routes by expert (qkv.nn.moe.sorted_routes), so the rows bound for rank q are contiguous;
       exchange the counts ((P, E/P) per rank, one all-to-all), then the rows x[route] (all-to-all);
    3. run each local expert once on the rows it received from every rank of the group;
    4. send the outputs back along the reversed splits (all-to-all);
    5. out[token] += g FFN_e(x[token]) for each route (index_add), as one process does.

An all-to-all's backward is the all-to-all of the gradients along the reversed splits (`AllToAll`), so the
backward retraces steps 4 and 2, and every rank runs both in every layer, also with nothing to send.

Gradients: data parallel's loss is L = 1/K sum_k L_k (each rank's batch mean) and DDP / FSDP2 average the
non-expert gradients as before. An expert's rank receives through step 4's backward sum_{k in its group}
dL_k / dtheta_e; the K / P copies of the expert (one per group, equal weights) sum that over their groups with
one all-reduce and divide by K: 1/K sum_k dL_k / dtheta_e, one process's gradient (note 000 LLM §7.1). An expert
no token chose keeps no gradient, as in one process (the optimizer skips it). Clipping measures the whole
gradient: the non-expert part as before, plus each expert's squares counted once (summed over a group).
ZeRO: zero=0 keeps the non-expert weights whole (DDP, the experts left out of its buckets); zero 2 and 3 shard
them over the K ranks (FSDP2, the experts ignored by it): the experts are sharded by expert parallel itself.
zero=1 (ZeroRedundancyOptimizer) is refused: it would broadcast one rank's expert shard over another's.

Checkpoints are one process's files: rank 0 receives every expert from the rank of the first group holding it,
and every resume cuts them again (each rank keeps its experts).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor, nn

from qkv.config import RunConfig
from qkv.errors import QkvError
from qkv.files import persistent_buffers
from qkv.nn.fastpath import is_dtensor
from qkv.nn.moe import MoE, sorted_routes
from qkv.parallel.stages import STATE_KEYS, release

def validate(cfg: RunConfig) -> None:
    """QkvError unless parallel.ep can split this model's experts over this layout's data-parallel ranks."""
    pc, mc = cfg.parallel, cfg.model
    if pc.ep == 1:
        return
    if not mc.moe_experts:
        raise QkvError(f"parallel.ep={pc.ep} places experts on ranks, but the model has none (model.moe_experts=0)")
    if pc.ep > mc.moe_experts:
        raise QkvError(f"parallel.ep={pc.ep} is more ranks than model.moe_experts={mc.moe_experts}: each rank "
                       "needs an expert")
    if mc.moe_experts % pc.ep:
        raise QkvError(f"parallel.ep={pc.ep} must divide model.moe_experts={mc.moe_experts}: each rank holds E / ep")
    if pc.dp % pc.ep:
        raise QkvError(f"parallel.ep={pc.ep} must divide parallel.dp={pc.dp}: the expert ranks are data-parallel ranks")
    if pc.tp > 1 or pc.pp > 1:
        raise QkvError(f"parallel.ep={pc.ep} runs beside data parallel only (set parallel.tp=1 and parallel.pp=1)")
    if pc.zero == 1:
        raise QkvError(f"parallel.ep={pc.ep} with parallel.zero=1: ZeroRedundancyOptimizer would copy one rank's "
                       "experts over another's; use parallel.zero=0, 2 or 3")
    if cfg.train.precision == "fp16":
        raise QkvError(f"parallel.ep={pc.ep} does not support train.precision=fp16 (each rank's loss scaler would "
                       "judge overflows on other experts); use bf16 or fp32")


class AllToAll(torch.autograd.Function):
    """rows (R, ...) cut into send[q] rows for rank q of `group` -> the rows received, recv[q] from rank q, in
    rank order. Backward: the gradients sent back along the reversed splits."""

    @staticmethod
    def forward(ctx, rows: Tensor, send: list[int], recv: list[int], group) -> Tensor:
        ctx.splits = send, recv, group
        out = rows.new_empty((sum(recv), *rows.shape[1:]))
        dist.all_to_all_single(out, rows.contiguous(), recv, send, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        send, recv, group = ctx.splits
        back = grad.new_empty((sum(send), *grad.shape[1:]))
        dist.all_to_all_single(back, grad.contiguous(), send, recv, group=group)
        return back, None, None, None


class ExpertParallelMoE(MoE):
    """An MoE layer whose experts are split over a group of `ep` ranks (`apply` sets group, ep and first, the
    index of this rank's first expert); the module docstring's steps 2-5."""

    group = None
    ep = 1
    first = 0

    def routed_output(self, tokens: Tensor, top: Tensor, gates: Tensor, kept: Tensor) -> Tensor:
        k, experts = top.shape[-1], len(self.experts)
        local = experts // self.ep
        routes, counts = sorted_routes(top, kept, experts)
        arriving = torch.empty_like(counts)  # [q * local + j]: rows from rank q for local expert j
        dist.all_to_all_single(arriving, counts, group=self.group)
        arriving = arriving.view(self.ep, local)
        send, recv = counts.view(self.ep, local).sum(1).tolist(), arriving.sum(1).tolist()
        rows = AllToAll.apply(tokens[routes // k], send, recv, self.group)  # by source rank, then expert
        expert_of = torch.arange(local, device=rows.device).repeat(self.ep).repeat_interleave(arriving.reshape(-1))
        order = torch.argsort(expert_of, stable=True)  # expert-major
        sizes = arriving.sum(0).tolist()
        outputs = [self.experts[self.first + j](part)
                   for j, part in enumerate(rows[order].split(sizes)) if sizes[j]]  # an idle expert is not run
        done = torch.cat([rows[:0], *outputs])[torch.argsort(order)]  # rows[:0]: in the graph with no rows
        back = AllToAll.apply(done, recv, send, self.group)  # (R, D) in `routes` order
        weight = gates.reshape(-1)[routes][:, None].to(tokens.dtype)
        return torch.zeros_like(tokens).index_add(0, routes // k, weight * back)


# ---- placing the experts ----------------------------------------------------------------------------
def moe_layers(model: nn.Module) -> list[tuple[str, MoE]]:
    return [(name, module) for name, module in model.named_modules() if isinstance(module, MoE)]


def expert_owner(model: nn.Module, ep: int) -> dict[str, int]:
    """Every expert parameter's name -> the rank of a group that holds it (expert e: e // (E / ep))."""
    owner = {}
    for prefix, layer in moe_layers(model):
        local = len(layer.experts) // ep
        for e, expert in enumerate(layer.experts):
            for name, _ in expert.named_parameters():
                owner[f"{prefix + '.' if prefix else ''}experts.{e}.{name}"] = e // local
    return owner


def apply(model: nn.Module, layout) -> dict[str, int]:
    """Split every MoE layer's experts over the layout's expert group, in place: this rank keeps its own and
    the others' parameters become meta tensors (names and order unchanged). Returns expert_owner(model)."""
    owner = expert_owner(model, layout.ep)
    for _, layer in moe_layers(model):
        layer.__class__ = ExpertParallelMoE
        layer.group, layer.ep, layer.first = layout.ep_group, layout.ep, layout.ep_rank * (len(layer.experts) // layout.ep)
    release(model, {id(p) for name, p in model.named_parameters() if owner.get(name, layout.ep_rank) == layout.ep_rank})
    return owner


def local_experts(model: nn.Module, owner: dict[str, int]) -> list[nn.Parameter]:
    return [p for name, p in model.named_parameters() if name in owner and not p.is_meta]


# ---- a step -----------------------------------------------------------------------------------------
@torch.no_grad()
def reduce_gradients(model: nn.Module, owner: dict[str, int], layout) -> None:
    """Each local expert's gradient: summed over its copies in the other groups and divided by dp (module
    docstring). A gradient no copy has stays None."""
    params = local_experts(model, owner)
    if layout.replicas is not None:
        present = torch.tensor([float(p.grad is not None) for p in params], device=layout.device)
        dist.all_reduce(present, group=layout.replicas)
        for param, there in zip(params, present.tolist()):
            if there:
                if param.grad is None:
                    param.grad = torch.zeros_like(param)
                dist.all_reduce(param.grad, group=layout.replicas)
    for param in params:
        if param.grad is not None:
            param.grad /= layout.dp


def clip_grad_norm(model: nn.Module, owner: dict[str, int], max_norm: float, layout) -> Tensor:
    """Global-norm clipping (note 000 LLM §4.3) of the whole gradient: the non-expert part (DTensor shards under
    FSDP2 reduced by torch) and each expert's squares once (summed over the group)."""
    others = [p for name, p in model.named_parameters() if name not in owner and p.grad is not None]
    experts = [p for p in local_experts(model, owner) if p.grad is not None]
    norm = torch.nn.utils.get_total_norm([p.grad for p in others]) if others else torch.zeros((), device=layout.device)
    if is_dtensor(norm):
        norm = norm.full_tensor()
    squares = sum((p.grad.float().square().sum() for p in experts), torch.zeros((), device=layout.device))
    dist.all_reduce(squares, group=layout.ep_group)
    total = (norm.float().square() + squares).sqrt()
    for params in (others, experts):  # FSDP2's DTensor gradients and plain ones are scaled apart
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return total


# ---- checkpoints: one process's files on rank 0, and back -----------------------------------------------
def to_main(value: Tensor | None, owner: int, shape, dtype, layout) -> Tensor | None:
    """An expert's tensor from rank `owner` of the first group on rank 0 (None elsewhere)."""
    if layout.rank == 0:
        if owner == 0:
            return value
        box = torch.empty(shape, dtype=dtype, device=layout.device)
        dist.recv(box, src=owner)
        return box
    if layout.rank == owner:
        dist.send(value.contiguous(), dst=0)
    return None


def whole(value: Tensor, layout) -> Tensor | None:
    """A non-expert tensor, whole, on rank 0 (an FSDP2 shard gathered over every rank: collective)."""
    value = value.full_tensor() if is_dtensor(value) else value
    return value if layout.rank == 0 else None


def resharded(model: nn.Module) -> None:
    """FSDP2 leaves a unit's whole weights registered after a forward without a backward (an evaluation); its
    sharded parameters, the optimizer's, come back with `reshard()`."""
    for module in model.modules():
        if callable(getattr(module, "reshard", None)):  # an FSDPModule
            module.reshard()


@torch.no_grad()
def full_weights(model: nn.Module, owner: dict[str, int], layout) -> dict[str, Tensor]:
    """The whole model's tensors as one process's files hold them, on rank 0 ({} elsewhere). Collective."""
    resharded(model)
    weights = {}
    for name, param in model.named_parameters():
        value = to_main(param, owner[name], param.shape, param.dtype, layout) if name in owner else whole(param, layout)
        if value is not None:
            weights[name] = value.detach().cpu().contiguous()
    return {**weights, **persistent_buffers(model)} if layout.rank == 0 else {}


@torch.no_grad()
def full_optimizer_state(model: nn.Module, owner: dict[str, int], optimizer: torch.optim.Optimizer,
                         layout) -> tuple[dict[str, Tensor], list[dict]]:
    """(tensors `optim.{i}.{key}`, JSON groups) as one process's optimizer writes them, on rank 0 ({} and []
    elsewhere): an expert's state from its rank (which keys it has, then each), the rest gathered. Collective."""
    resharded(model)
    names = {id(p): name for name, p in model.named_parameters()}
    tensors = {}
    for index, param in enumerate(p for group in optimizer.param_groups for p in group["params"]):
        name = names[id(param)]
        state = optimizer.state.get(param, {})
        if name in owner:
            rank = owner[name]
            flags = torch.tensor([float(key in state) for key in STATE_KEYS], device=layout.device)
            flags = to_main(flags, rank, flags.shape, flags.dtype, layout)
            keys = [key for key, there in zip(STATE_KEYS, flags.tolist()) if there] if layout.rank == 0 else \
                [key for key in STATE_KEYS if key in state] if layout.rank == rank else []
            values = {key: to_main(state.get(key), rank, () if key == "step" else param.shape,
                                   torch.float32 if key == "step" else param.dtype, layout) for key in keys}
        else:
            values = {key: whole(value, layout) for key, value in state.items() if torch.is_tensor(value)}
        tensors.update({f"optim.{index}.{key}": value.cpu().contiguous()
                        for key, value in values.items() if value is not None})
    return (tensors, optimizer.state_dict()["param_groups"]) if layout.rank == 0 else ({}, [])
