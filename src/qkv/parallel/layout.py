"""Distributed training on torch.distributed: the process layout from torchrun's environment, and the
wrappers applied to a finished single-device model from outside, in torchtitan's order (tensor parallel,
activation checkpointing, data parallel). docs/distributed.md compares each mode with note 000 LLM §7.

Data parallel over K = parallel.dp ranks (note 000 LLM §7.1 "梯度平均"): rank k computes g_k on its b/K
rows of the global batch and every rank applies g = 1/K sum_k g_k, which is the gradient of the whole
batch, so K processes reproduce one process (up to the order of float sums).
ZeRO (note 000 LLM §7.3) keeps that update and shards the training state over the K ranks:
    zero=0  DDP: every rank holds weights, gradients and optimizer states; gradients all-reduced
    zero=1  DDP + ZeroRedundancyOptimizer: rank k keeps the Adam moments of 1/K of the parameters,
            updates them and broadcasts them ("优化器状态分区")
    zero=2  FSDP2 fully_shard, reshard_after_forward=False: gradients reduce-scattered and kept as 1/K
            shards ("梯度分区"); each block's gathered weights stay from the forward to the backward
    zero=3  FSDP2 fully_shard, reshard_after_forward=True: weights sharded too, gathered block by block
            in the forward and again in the backward ("参数分区", "前向/反向传播时广播/收集参数")
The mesh is (pp, dp, tp), tp innermost; gloo on CPU, NCCL on CUDA. Expert parallel (parallel.ep) splits the
experts of each MoE layer over groups of ep data-parallel ranks: qkv.parallel.experts.
"""
from __future__ import annotations

import contextlib
import inspect
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from qkv.config import RunConfig
from qkv.errors import QkvError
from qkv.nn.fastpath import is_dtensor
from qkv.nn.block import Block
from qkv.nn.moe import MoE
from qkv.parallel.memory import apply_activation_checkpointing
from qkv.files import load_optimizer, model_tensors, optimizer_tensors
from qkv.parallel import experts, pipeline

if TYPE_CHECKING:  # torch.distributed.tensor and device_mesh take seconds to import: a single process never does
    from torch.distributed.device_mesh import DeviceMesh


@dataclass(frozen=True)
class Layout:
    """Where this process sits: rank in the world, the dp x tp x pp sizes, the mesh and the device."""

    rank: int = 0
    world: int = 1
    dp: int = 1
    tp: int = 1
    pp: int = 1
    zero: int = 0
    device: torch.device = torch.device("cpu")
    mesh: DeviceMesh | None = None  # (pp, dp, tp); None in a single process
    dp_rank: int = 0  # this rank's coordinate along dp: which rows of each global batch it reads
    ep: int = 1  # expert parallel (qkv.parallel.experts): experts split over groups of ep consecutive dp ranks
    ep_rank: int = 0  # this rank's place in its expert group
    ep_group: object = None  # its expert group's process group (ep > 1)
    replicas: object = None  # the ranks holding the same experts in the other groups (dp > ep)

    @property
    def is_main(self) -> bool:
        """Rank 0 writes the run dir, the logs and the messages."""
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world > 1

    def shard(self, rows: np.ndarray) -> np.ndarray:
        """This rank's rows of a global batch: rows dp_rank::dp, the rule of qkv.data's samplers, so the
        dp shards are disjoint and together are the batch."""
        return np.ascontiguousarray(rows[self.dp_rank :: self.dp])

    def dp_mean(self, value: torch.Tensor) -> torch.Tensor:
        """The mean of `value` over the dp ranks (a per-rank batch mean becomes the global batch mean)."""
        if self.dp == 1:
            return value
        value = value.clone()
        dist.all_reduce(value, op=dist.ReduceOp.SUM, group=self.mesh["dp"].get_group())  # gloo has no AVG
        return value / self.dp

    def from_main(self, value: float) -> float:
        """Rank 0's value on every rank (clock readings: all ranks must stop and schedule alike)."""
        if not self.distributed:
            return value
        box = torch.tensor(value, dtype=torch.float64, device=self.device)
        dist.broadcast(box, src=0)
        return box.item()

    def any(self, flag: bool) -> bool:
        """True on every rank when it is true on one (a Ctrl-C that reached some ranks only)."""
        if not self.distributed:
            return flag
        value = torch.tensor(float(flag), device=self.device)
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
        return bool(value.item())

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier()


def env_rank() -> int:
    """This process's rank as torchrun sets it (0 outside torchrun)."""
    return int(os.environ.get("RANK", "0"))


def resolve_device(name: str) -> torch.device:
    """train.device: auto (CUDA when there is one), cpu, cuda or cuda:N."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise QkvError(f"train.device={name!r} but no CUDA device is available; use cpu or auto")
    try:
        return torch.device(name)
    except RuntimeError:
        raise QkvError(f"train.device={name!r} is not a device; use auto, cpu, cuda or cuda:N") from None


def env_world() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def check_world(cfg: RunConfig, world: int) -> None:
    """QkvError unless parallel.dp x tp x pp is this launch's process count (asked before a new run's dir is
    made: under torchrun a rank that leaves first may stop the others before they clean up)."""
    pc = cfg.parallel.validate()
    needed = pc.dp * pc.tp * pc.pp
    if needed != world:
        launch = f"torchrun --nproc-per-node {needed} -m qkv train ..." if needed > 1 else "qkv train ..."
        raise QkvError(f"parallel.dp x tp x pp = {pc.dp} x {pc.tp} x {pc.pp} = {needed} process"
                       f"{'es' if needed > 1 else ''}, but this launch has world size {world}; start it with "
                       f"`{launch}` or change parallel.*")


def check_layout(cfg: RunConfig, world: int) -> None:
    """QkvError unless parallel.dp x tp x pp processes fit this launch, the model and the batch."""
    check_world(cfg, world)
    pc, tc = cfg.parallel.validate(), cfg.train
    experts.validate(cfg)  # parallel.ep's own rules first: they name the expert layout
    if pc.zero and pc.dp == 1:
        raise QkvError(f"parallel.zero={pc.zero} shards over data-parallel ranks and needs parallel.dp > 1")
    if pc.dp > 1 and pc.tp > 1 and pc.zero < 2:
        raise QkvError(f"parallel.dp={pc.dp} with parallel.tp={pc.tp} needs parallel.zero=2 or 3 (FSDP2): "
                       f"DDP and ZeroRedundancyOptimizer do not take tensor-parallel (DTensor) weights")
    if pc.zero >= 2 and tc.precision == "fp16":
        raise QkvError(f"parallel.zero={pc.zero} (FSDP2) does not support train.precision=fp16 (its loss scaler "
                       f"would decide overflows per shard); use train.precision=bf16 or fp32")
    if tc.batch_size % (pc.dp * tc.accumulation):
        raise QkvError(f"train.batch_size={tc.batch_size} must split into parallel.dp={pc.dp} shards of "
                       f"train.accumulation={tc.accumulation} equal micro-batches")
    layers = cfg.model.n_layers if cfg.model.arch != "encoder-decoder" else None
    if pc.pp > 1 and layers is not None and pc.pp > layers:
        raise QkvError(f"parallel.pp={pc.pp} is larger than model.n_layers={layers}: each stage needs a layer")
    if pc.tp > 1:
        from qkv.parallel import tensor as tensor_parallel  # torch.distributed.tensor: only for tensor parallel

        tensor_parallel.validate(cfg.model, pc.tp)
    if pc.pp > 1:
        pipeline.validate(cfg, pc.dp)


def setup(cfg: RunConfig, device: torch.device) -> Layout:
    """Check the layout and, under torchrun (WORLD_SIZE > 1), join the process group: NCCL when `device`
    is CUDA (each process takes cuda:LOCAL_RANK), gloo on CPU. A single process needs no group."""
    world = env_world()
    check_layout(cfg, world)
    pc = cfg.parallel
    if world == 1:
        return Layout(device=device)
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    from torch.distributed.device_mesh import init_device_mesh

    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    mesh = init_device_mesh(device.type, (pc.pp, pc.dp, pc.tp), mesh_dim_names=("pp", "dp", "tp"))
    rank = dist.get_rank()
    ep_group = replicas = None  # under ep > 1 tp = pp = 1: a rank's dp coordinate is its rank
    for first in range(0, world, pc.ep) if pc.ep > 1 else ():  # every rank makes every group, in one order
        group = dist.new_group(list(range(first, first + pc.ep)))
        ep_group = group if first <= rank < first + pc.ep else ep_group
    for place in range(pc.ep) if 1 < pc.ep < pc.dp else ():
        group = dist.new_group(list(range(place, world, pc.ep)))
        replicas = group if rank % pc.ep == place else replicas
    return Layout(rank=rank, world=world, dp=pc.dp, tp=pc.tp, pp=pc.pp, zero=pc.zero, device=device,
                  mesh=mesh, dp_rank=mesh["dp"].get_local_rank(), ep=pc.ep, ep_rank=rank % pc.ep,
                  ep_group=ep_group, replicas=replicas)


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


# ---- wrapping a finished model ---------------------------------------------------------------------
def parallelize(model: nn.Module, cfg: RunConfig, layout: Layout, *, tensor: bool = True) -> nn.Module:
    """Tensor parallel, activation checkpointing, then data parallel (torchtitan's order). Returns the
    module to call in the training forward: the DDP wrapper, or `model` itself (FSDP2 and tensor parallel
    change it in place). Parameter names never change. The pipeline split (parallel.pp) is done by
    qkv.parallel.pipeline before this, on each stage's module (`tensor=False`: the whole model is already split)."""
    if layout.tp > 1 and tensor:
        from qkv.parallel import tensor as tensor_parallel  # torch.distributed.tensor: only for tensor parallel

        tensor_parallel.apply(model, layout.mesh["tp"], cfg.model)
    owner = experts.apply(model, layout) if layout.ep > 1 else {}  # the other ranks' experts: meta tensors
    if cfg.train.activation_checkpointing:
        apply_activation_checkpointing(model, save_attention=True)  # docs/training.md: +5% vs +37% time
    if layout.dp == 1:
        return model
    if layout.zero >= 2:
        return shard_fully(model, layout.mesh["dp"], reshard_after_forward=layout.zero == 3, ignored=owner)
    from torch.nn.parallel import DistributedDataParallel

    if owner:  # expert parallel's experts: reduced by qkv.parallel.experts, not in DDP's buckets
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, list(owner))
    has_moe = not owner and any(isinstance(module, MoE) for module in model.modules())  # top-k: experts unused
    return DistributedDataParallel(model, process_group=layout.mesh["dp"].get_group(),
                                   device_ids=[layout.device.index] if layout.device.type == "cuda" else None,
                                   forward_sync_buffers=False, find_unused_parameters=has_moe,
                                   gradient_as_bucket_view=True)  # gradients live in the all-reduce buckets


def unwrapped(module: nn.Module) -> nn.Module:
    """The model inside `parallelize`'s DDP wrapper (FSDP2 and tensor parallel change it in place): where
    the objectives find the head they run on the wrapper's output."""
    from torch.nn.parallel import DistributedDataParallel

    return module.module if isinstance(module, DistributedDataParallel) else module


def shard_fully(model: nn.Module, dp_mesh: DeviceMesh, *, reshard_after_forward: bool,
                ignored: dict[str, int] | None = None) -> nn.Module:
    """FSDP2: one all-gather / reduce-scatter unit per block, the rest (embeddings, final norm, head) in
    the root unit, as torchtitan wraps its Llama. Weights stay fp32 (autocast handles bf16). The root
    unit stays gathered from its forward into the backward (FSDP2's own heuristic for the root): the
    objective runs the head and the loss on the model's output, and the backward starts with them.
    `ignored`: parameter names FSDP2 leaves alone (expert parallel's experts)."""
    from torch.distributed.fsdp import fully_shard

    ignored = {p for name, p in model.named_parameters() if name in (ignored or {})}
    for module in model.modules():
        if isinstance(module, Block):
            fully_shard(module, mesh=dp_mesh, reshard_after_forward=reshard_after_forward,
                        ignored_params={p for p in module.parameters() if p in ignored} or None)
    fully_shard(model, mesh=dp_mesh, reshard_after_forward=False, ignored_params=ignored or None)
    return model


def shard_optimizer(optimizer: torch.optim.Optimizer, layout: Layout) -> torch.optim.Optimizer:
    """zero=1: the same optimizer (class, groups, hyper-parameters) with its states sharded over dp."""
    if layout.zero != 1:
        return optimizer
    from torch.distributed.optim import ZeroRedundancyOptimizer

    groups = [dict(group) for group in optimizer.param_groups]
    accepted = inspect.signature(type(optimizer)).parameters  # AdamW's defaults hold one it does not take
    defaults = {key: value for key, value in optimizer.defaults.items() if key in accepted}
    return ZeroRedundancyOptimizer(groups, optimizer_class=type(optimizer),
                                   process_group=layout.mesh["dp"].get_group(), **defaults)


def grad_sync(module: nn.Module, enabled: bool):
    """Skip the gradient all-reduce / reduce-scatter on all but the last micro-batch of an accumulated
    step (the sum is the same; it is communicated once)."""
    if hasattr(module, "no_sync"):  # DDP
        return module.no_sync() if not enabled else contextlib.nullcontext()
    if hasattr(module, "set_requires_gradient_sync"):  # FSDP2
        module.set_requires_gradient_sync(enabled)
    return contextlib.nullcontext()


def clip_grad_norm(parameters, max_norm: float) -> torch.Tensor:
    """Global-norm clipping (note 000 LLM §4.3) over plain or DTensor gradients: with FSDP2 / tensor
    parallel each rank holds shards, and the norm of the whole gradient is reduced over them."""
    parameters = [p for p in parameters if p.grad is not None]
    norm = torch.nn.utils.get_total_norm([p.grad for p in parameters])
    if is_dtensor(norm):
        norm = norm.full_tensor()
    torch.nn.utils.clip_grads_with_norm_(parameters, max_norm, norm)
    return norm



# ---- full state dicts for qkv's safetensors checkpoints ---------------------------------------------
def full_model_state(model: nn.Module, layout: Layout) -> dict[str, torch.Tensor]:
    """The whole model's tensors on rank 0 (empty elsewhere), named as in a single process: parameters
    (a tied weight once, under its first name) and persistent buffers. Collective."""
    if not layout.distributed:
        return model_tensors(model)
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    unique = {name for name, _ in model.named_parameters()}
    every = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    return {name: t.contiguous() for name, t in full.items() if name in unique or name not in every}


def full_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer,
                         layout: Layout) -> tuple[dict[str, torch.Tensor], list[dict]]:
    """(tensors `optim.{index}.{key}`, JSON param groups) as a single process's optimizer writes them, on
    rank 0 ({} and [] elsewhere): index i is the i-th parameter of the groups in order. Collective."""
    if not layout.distributed:
        return optimizer_tensors(optimizer)
    if layout.zero == 1:
        optimizer.consolidate_state_dict(to=0)
        return optimizer_tensors(optimizer) if layout.is_main else ({}, [])
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    full = get_optimizer_state_dict(model, optimizer,
                                    options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if not layout.is_main:
        return {}, []
    index = {name: i for i, name in enumerate(name for group in full["param_groups"] for name in group["params"])}
    tensors = {f"optim.{index[name]}.{key}": torch.as_tensor(value).contiguous()
               for name, entry in full["state"].items() for key, value in entry.items()}
    groups = [{**group, "params": [index[name] for name in group["params"]]} for group in full["param_groups"]]
    return tensors, groups


def load_full_optimizer(model: nn.Module, optimizer: torch.optim.Optimizer, tensors: dict[str, torch.Tensor],
                        groups: list[dict], layout: Layout) -> None:
    """Load a single-process-format optimizer state (see full_optimizer_state) into any layout; every rank
    reads the same files. DDP and ZeRO-1 take it as it is (ZeRO-1 keeps its own partition)."""
    if layout.zero < 2 and layout.tp == 1:
        return load_optimizer(optimizer, tensors, groups)
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    names = {id(param): name for name, param in model.named_parameters()}
    order = [names[id(param)] for group in optimizer.param_groups for param in group["params"]]
    state: dict[str, dict] = {}
    for key, value in tensors.items():
        if key.startswith("optim."):
            _, index, field = key.split(".", 2)
            state.setdefault(order[int(index)], {})[field] = value
    full = {"state": state, "param_groups": [{**group, "params": [order[i] for i in group["params"]]}
                                             for group in groups]}
    try:
        set_optimizer_state_dict(model, optimizer, full, options=StateDictOptions(full_state_dict=True))
    except (ValueError, KeyError, RuntimeError, IndexError) as exc:
        raise QkvError(f"optimizer state does not match the model ({exc})") from None
