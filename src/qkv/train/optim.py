"""Optimizers (note 000 §17.1; LLM part §4.1, §10.3), built by name with one signature
`(model, cfg: TrainConfig) -> torch.optim.Optimizer`.

Weight decay applies to matrices (linear and embedding weights) and not to biases and norm gains,
as in GPT-2/nanoGPT: decaying a LayerNorm gain towards 0 fights the normalisation.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from qkv.registry import Registry

OPTIMIZERS: Registry[Callable[..., torch.optim.Optimizer]] = Registry("optimizer")


def parameter_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


@OPTIMIZERS.register("adamw")
def adamw(model: nn.Module, cfg) -> torch.optim.Optimizer:
    """Adam with decoupled weight decay: theta -= lr * (m_hat / (sqrt(v_hat) + eps) + wd * theta)."""
    return torch.optim.AdamW(parameter_groups(model, cfg.weight_decay), lr=cfg.lr,
                             betas=(cfg.beta1, cfg.beta2), eps=cfg.eps)


@OPTIMIZERS.register("adam")
def adam(model: nn.Module, cfg) -> torch.optim.Optimizer:
    """Adam with coupled L2: the decay term wd * theta is added to the gradient before the moments."""
    return torch.optim.Adam(parameter_groups(model, cfg.weight_decay), lr=cfg.lr,
                            betas=(cfg.beta1, cfg.beta2), eps=cfg.eps)


@OPTIMIZERS.register("sgd")
def sgd(model: nn.Module, cfg) -> torch.optim.Optimizer:
    """SGD with momentum beta1 and coupled L2 decay."""
    return torch.optim.SGD(parameter_groups(model, cfg.weight_decay), lr=cfg.lr, momentum=cfg.beta1)
