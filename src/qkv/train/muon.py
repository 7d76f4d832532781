"""Muon (Jordan et al. 2024, "Muon: an optimizer for hidden layers"; used by modded-nanogpt) for the hidden
matrices, AdamW for everything else, as one torch optimizer (`train.optimizer=muon`).

For each hidden weight matrix W (every 2-D parameter inside the blocks: attention projections, FFN
matrices, experts, routers):
    B <- mu B + G                                   momentum (mu = train.muon_momentum)
    U <- G + mu B                                   Nesterov
    O <- NS5(U)                                     ~ the polar factor U (U^T U)^(-1/2): singular values -> ~1
    W <- W - lr_m (O sqrt(max(1, rows / cols)) + wd W)
The other parameters take torch's AdamW update (torch.optim.adamw.adamw) in the same optimizer.
NS5 is the quintic Newton-Schulz iteration X <- a_k X + (b_k A + c_k A^2) X, A = X X^T, k = 1..5, from
X = U / (s ||U||_F), with train.muon_iteration's coefficients (qkv.ref.optim.NS_ITERATIONS): "jordan", Muon's
own (a, b, c) = (3.4445, -4.7750, 2.0315) five times (s = 1); or "polar_express" (Amsel et al. 2025), a
minimax quintic of its own for each step (s = 1.02), which lands the singular values closer to 1 with the
same five steps and products (on the default job no better at equal steps over five seeds: docs/recipe.md).
The iteration is a polynomial in U U^T, so it keeps U's singular vectors and maps each singular value
x = sigma / (s ||U||_F) through the scalar iteration p_k(x) = a_k x + b_k x^3 + c_k x^5
(tests/train/test_muon.py checks both against an SVD). It runs in float32, or in
bfloat16 when the run trains in bf16 (train.precision bf16, or auto on a device that multiplies bf16 natively),
as torch.optim.Muon (torch >= 2.9) and modded-nanogpt iterate: the normalisation stays fp32, the products bf16.
On a CPU that emulates bf16 that would be slow, and auto never picks bf16 there.
The embedding, the output head, norm gains and biases take AdamW with train.lr, train.beta1/2.
lr_m follows the same schedule as lr: the Muon group's "lr_scale" is train.muon_lr / train.lr, and the
Trainer sets each group's rate to schedule(step) * lr_scale.
"""
from __future__ import annotations

import math

import torch
from torch import nn
from torch.optim.adamw import adamw

from qkv.ref.optim import NS_ITERATIONS
from qkv.train.fused import fused_applies


@torch.no_grad()
def newton_schulz(update: torch.Tensor, dtype: torch.dtype | None = None,
                  iteration: str = "jordan") -> torch.Tensor:
    """NS5(U) for a 2-D U (or a batch of them), in float32 at least (float64 stays float64); with `dtype`
    (bfloat16) the iteration's products run in it and the result comes back in U's precision. `iteration`:
    the coefficients (qkv.ref.optim.NS_ITERATIONS)."""
    steps, safety = NS_ITERATIONS.get(iteration)
    wide = torch.promote_types(update.dtype, torch.float32)
    x = update.to(wide)
    tall = x.shape[-2] > x.shape[-1]
    if tall:  # iterate on the wide orientation: A = X X^T is the smaller Gram matrix
        x = x.mT
    x = x / (safety * torch.linalg.matrix_norm(x, keepdim=True) + 1e-7)
    if dtype is not None:
        x = x.to(dtype)
    for a, b, c in steps:
        gram = x @ x.mT
        x = a * x + (b * gram + c * gram @ gram) @ x
    x = x.to(wide)
    return x.mT if tall else x


def orthogonalised(updates: list[torch.Tensor], dtype: torch.dtype | None = None,
                   iteration: str = "jordan") -> list[torch.Tensor]:
    """NS5 of each update, the matrices of one shape stacked into one batched iteration: the same polynomial
    per matrix (tests/train/test_muon.py), one call per shape instead of one per matrix (the default preset's
    24 matrices are 3 calls; its optimizer step 16.6-18.6 -> 12.6-12.9 ms on 2 cores, docs/recipe.md)."""
    by_shape: dict[tuple, list[int]] = {}
    for i, u in enumerate(updates):
        by_shape.setdefault((tuple(u.shape), u.dtype, u.device), []).append(i)
    out: list[torch.Tensor] = [None] * len(updates)  # type: ignore[list-item]
    for indices in by_shape.values():
        stacked = newton_schulz(torch.stack([updates[i] for i in indices]), dtype, iteration)
        for i, o in zip(indices, stacked.unbind(0)):
            out[i] = o
    return out


def hidden_matrices(model: nn.Module) -> set[int]:
    """ids of the 2-D parameters inside the blocks (what Muon updates)."""
    return {id(p) for name, p in model.named_parameters()
            if p.requires_grad and p.dim() == 2 and ".blocks." in f".{name}"}


class MuonAdamW(torch.optim.Optimizer):
    """Groups with "muon": True take the Muon update; the others AdamW. One state dict for both."""

    def __init__(self, groups: list[dict], *, lr: float, betas: tuple[float, float], eps: float,
                 momentum: float, ns_dtype: torch.dtype | None = None, iteration: str = "jordan"):
        defaults = dict(lr=lr, betas=betas, eps=eps, momentum=momentum, weight_decay=0.0, muon=False)
        super().__init__(groups, defaults)
        self.ns_dtype = ns_dtype  # the Newton-Schulz products' precision (None: fp32); not in the state dict
        self.iteration = iteration  # the Newton-Schulz coefficients (NS_ITERATIONS); a setting, not state

    @torch.no_grad()
    def step(self, closure=None):
        loss = None if closure is None else closure()
        for group in self.param_groups:
            (self._muon if group["muon"] else self._adamw)(group)
        return loss

    def _muon(self, group: dict) -> None:
        mu, lr, wd = group["momentum"], group["lr"], group["weight_decay"]
        params = [p for p in group["params"] if p.grad is not None]
        updates = []
        for p in params:
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(p)
            buf = state["momentum_buffer"]
            buf.mul_(mu).add_(p.grad)
            updates.append(p.grad.add(buf, alpha=mu))  # Nesterov
        for p, update in zip(params, orthogonalised(updates, self.ns_dtype, self.iteration)):
            scale = math.sqrt(max(1.0, p.shape[-2] / p.shape[-1]))
            p.mul_(1.0 - lr * wd).add_(update.to(p.dtype), alpha=-lr * scale)

    def _adamw(self, group: dict) -> None:
        """torch's own AdamW update (torch.optim.adamw.adamw, fused where it applies) on this group."""
        params = [p for p in group["params"] if p.grad is not None]
        for p in params:
            state = self.state[p]
            if "step" not in state:
                state.update(step=torch.zeros((), dtype=torch.float32), exp_avg=torch.zeros_like(p),
                             exp_avg_sq=torch.zeros_like(p))
        states = [self.state[p] for p in params]
        (beta1, beta2) = group["betas"]
        adamw(params, [p.grad for p in params], [s["exp_avg"] for s in states], [s["exp_avg_sq"] for s in states],
              [], [s["step"] for s in states], fused=fused_applies([{"params": params}]) or None,
              amsgrad=False, beta1=beta1, beta2=beta2, lr=group["lr"], weight_decay=group["weight_decay"],
              eps=group["eps"], maximize=False)


def muon(model: nn.Module, cfg) -> torch.optim.Optimizer:
    """Muon on the hidden matrices (lr train.muon_lr, decay train.weight_decay), AdamW on the rest
    (lr train.lr; decay on the embedding and head matrices only, as qkv.train.optim.parameter_groups)."""
    hidden = hidden_matrices(model)
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if id(p) in hidden], "muon": True, "lr": cfg.muon_lr,
         "lr_scale": cfg.muon_lr / cfg.lr, "weight_decay": cfg.weight_decay},
        {"params": [p for p in params if id(p) not in hidden and p.dim() >= 2], "weight_decay": cfg.weight_decay},
        {"params": [p for p in params if id(p) not in hidden and p.dim() < 2], "weight_decay": 0.0},
    ]
    ns_dtype = torch.bfloat16 if cfg.precision == "bf16" else None  # the run's precision (auto resolved)
    return MuonAdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, momentum=cfg.muon_momentum,
                     ns_dtype=ns_dtype, iteration=cfg.muon_iteration)


muon.whole_matrices = True  # the update orthogonalises whole matrices: no ZeRO / FSDP or tensor-parallel shards
