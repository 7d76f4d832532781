"""Optimizers (note 000 §17.1; LLM part §4.1, §10.3), built by name with one signature
`(model, cfg: TrainConfig) -> torch.optim.Optimizer`.

Weight decay applies to matrices (linear and embedding weights) and not to biases and norm gains,
as in GPT-2/nanoGPT: decaying a LayerNorm gain towards 0 fights the normalisation.

Adam and AdamW run torch's fused kernel (`fused=True`: one pass over each parameter, moments and gradient)
wherever it applies (plain CPU or CUDA floating-point tensors); its update is the same formula as the
per-tensor loop, equal to float rounding (tests/train/test_optim.py), and about 4x faster on CPU
(benchmarks/run.py). Other tensors (e.g. distributed DTensor shards) get torch's default implementation.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from qkv.registry import Registry
from qkv.train.fused import fused_applies
from qkv.train.muon import muon  # its own module: the Newton-Schulz iteration and the update

OPTIMIZERS: Registry[Callable[..., torch.optim.Optimizer]] = Registry("optimizer")


def parameter_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


@OPTIMIZERS.register("adamw")
def adamw(model: nn.Module, cfg) -> torch.optim.Optimizer:
    """Adam with decoupled weight decay: theta -= lr * (m_hat / (sqrt(v_hat) + eps) + wd * theta)."""
    groups = parameter_groups(model, cfg.weight_decay)
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps,
                             fused=fused_applies(groups) or None)


@OPTIMIZERS.register("adam")
def adam(model: nn.Module, cfg) -> torch.optim.Optimizer:
    """Adam with coupled L2: the decay term wd * theta is added to the gradient before the moments."""
    groups = parameter_groups(model, cfg.weight_decay)
    return torch.optim.Adam(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps,
                            fused=fused_applies(groups) or None)


@OPTIMIZERS.register("sgd")
def sgd(model: nn.Module, cfg) -> torch.optim.Optimizer:
    """SGD with momentum beta1 and coupled L2 decay."""
    return torch.optim.SGD(parameter_groups(model, cfg.weight_decay), lr=cfg.lr, momentum=cfg.beta1)


OPTIMIZERS.register("muon")(muon)
