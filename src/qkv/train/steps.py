"""One step's forward and backward, per layout: the Trainer asks its runner and never the layout.

A runner has these methods:

    forward_backward(batch, backward) -> (loss, aux)   the batch-mean loss and MoE aux loss, gradients in place
    clip(max_norm) -> norm                             global-norm clipping over every rank's share
    evaluator() -> (module, loss or None)              what evaluation calls (the model and the objective's loss,
                                                       or the pipeline's stages and theirs)
    full_weights() -> tensors                          the whole model as one process's files hold it, on rank 0
    full_state(optimizer) -> (weights, tensors, groups)  and the optimizer's state likewise (collective)
    load_optimizer(optimizer, tensors, groups)         a single-process optimizer state into this layout

`MicroBatches` serves one process, data parallel (DDP, ZeRO via FSDP2) and tensor parallel: the batch (this
rank's b / dp rows) in micro-batches of batch_size / accumulation / dp rows, each weighted by its share b_i / b
(note 000 LLM §10.4: the accumulated gradient is the gradient of the whole batch), communicated once per step.
`ExpertBatches` is MicroBatches with expert parallel: the experts' gradients, norm and state its own
(qkv.parallel.experts).
The pipeline's runner is qkv.parallel.pipeline.Pipeline.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor, nn

from qkv.config import RunConfig
from qkv.parallel import experts
from qkv.parallel import layout as parallel
from qkv.parallel.pipeline import Pipeline
from qkv.parallel.stages import load_resident_optimizer

# backward(module, micro, share) -> (loss, aux), both detached: one micro-batch's forward and backward
Backward = Callable[[nn.Module, tuple[Tensor, ...], float], tuple[Tensor, Tensor]]


class MicroBatches:
    def __init__(self, model: nn.Module, cfg: RunConfig, layout: parallel.Layout):
        # from outside, in torchtitan's order: tensor parallel, activation checkpointing, DDP / FSDP2;
        # model keeps the parameter names, wrapped is what the training forward calls
        self.model, self.wrapped = model, parallel.parallelize(model, cfg, layout)
        self.micro_rows = cfg.train.batch_size // cfg.train.accumulation // layout.dp
        self.device, self.layout = layout.device, layout

    def forward_backward(self, batch: tuple[Tensor, ...], backward: Backward) -> tuple[Tensor, Tensor]:
        rows = len(batch[0])
        micros = list(zip(*(tensor.split(self.micro_rows) for tensor in batch)))
        total = aux_total = 0.0  # sums in the losses' own dtype (an fp64 model's loss is not rounded to fp32)
        for i, micro in enumerate(micros):
            share = len(micro[0]) / rows  # b_i / b: 1 / accumulation for a full batch
            with parallel.grad_sync(self.wrapped, enabled=i == len(micros) - 1):  # communicate once per step
                loss, aux = backward(self.wrapped, micro, share)
            total = total + loss * share
            aux_total = aux_total + aux * share
        return total, aux_total

    def clip(self, max_norm: float) -> Tensor:
        return parallel.clip_grad_norm(self.model.parameters(), max_norm)  # also over FSDP2 / TP shards

    def evaluator(self) -> tuple[nn.Module, None]:
        return self.model, None  # every rank's model (or its shards) is the trained one; the objective's loss

    def full_weights(self) -> dict[str, Tensor]:
        return parallel.full_model_state(self.model, self.layout)

    def full_state(self, optimizer: torch.optim.Optimizer) -> tuple[dict, dict[str, Tensor], list[dict]]:
        return (self.full_weights(), *parallel.full_optimizer_state(self.model, optimizer, self.layout))

    def load_optimizer(self, optimizer: torch.optim.Optimizer, tensors: dict[str, Tensor], groups: list[dict]) -> None:
        parallel.load_full_optimizer(self.model, optimizer, tensors, groups, self.layout)


def runner_for(model: nn.Module, cfg: RunConfig, layout: parallel.Layout, scaler=None):
    """parallel.pp > 1: this rank's pipeline stage under its schedule (tensor parallel splits the whole
    model first, data parallel wraps the stage); else micro-batches."""
    if layout.pp > 1:
        if layout.tp > 1:
            from qkv.parallel import tensor as tensor_parallel  # torch.distributed.tensor: only for tensor parallel

            tensor_parallel.apply(model, layout.mesh["tp"], cfg.model, split_logits=False)  # the stage's loss
        return Pipeline(model, layout.mesh["pp"], cfg, layout.device, dp=layout.dp, tp=layout.tp, scaler=scaler,
                        wrap=lambda stage: parallel.parallelize(stage, cfg, layout, tensor=False))
    return ExpertBatches(model, cfg, layout) if layout.ep > 1 else MicroBatches(model, cfg, layout)


class ExpertBatches(MicroBatches):
    """MicroBatches whose model's experts are split over expert groups (parallel.ep > 1)."""

    def __init__(self, model: nn.Module, cfg: RunConfig, layout: parallel.Layout):
        super().__init__(model, cfg, layout)
        self.owner = experts.expert_owner(model, layout.ep)  # expert parameter -> its rank in a group

    def forward_backward(self, batch: tuple[Tensor, ...], backward: Backward) -> tuple[Tensor, Tensor]:
        result = super().forward_backward(batch, backward)
        experts.reduce_gradients(self.model, self.owner, self.layout)
        return result

    def clip(self, max_norm: float) -> Tensor:
        return experts.clip_grad_norm(self.model, self.owner, max_norm, self.layout)

    def full_weights(self) -> dict[str, Tensor]:
        return experts.full_weights(self.model, self.owner, self.layout)

    def full_state(self, optimizer: torch.optim.Optimizer) -> tuple[dict, dict[str, Tensor], list[dict]]:
        return (self.full_weights(), *experts.full_optimizer_state(self.model, self.owner, optimizer, self.layout))

    def load_optimizer(self, optimizer: torch.optim.Optimizer, tensors: dict[str, Tensor], groups: list[dict]) -> None:
        load_resident_optimizer(optimizer, tensors, groups)
