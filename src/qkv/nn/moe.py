"""Mixture-of-Experts FFN with top-k gating and a load-balancing loss (note 002 "混合专家"; note 000 LLM
§6.3 auxiliary losses; Shazeer et al. 2017, Switch Transformer (Fedus et al. 2022), GShard capacity):

    p = softmax(x W_r^T)                 router probabilities over E experts   (N, E)
    top = the k largest p per token;     g = softmax(logits[top]) = p[top] / sum p[top]
    y = sum_{e in top, kept} g_e FFN_e(x)
    aux = E * sum_e f_e P_e              f_e = share of the N k routes that go to e (no gradient),
                                         P_e = mean_n p_ne (Switch eq. 4; top-1 gives Switch's f_e)

Note 002's sketch averages the chosen experts' outputs with weight 1/k and no gate, so the router gets no
gradient; qkv weighs them by the renormalised gates (docs/DEVIATIONS.md), as qkv.ref.moe does.
Capacity (model.moe_capacity_factor = c > 0): each expert takes at most ceil(c N k / E) routes of a forward
call, served by position (every row's position 0, then position 1, ...; a token's first choice before its
second), so a token is never dropped because of a later one: the decoder stays causal. A dropped route adds
nothing; a token whose every route is dropped leaves the FFN as 0 and the block passes it on through the
residual alone. Capacity is per call (N tokens), so a KV-cache step (N = B) is not the full pass: it is a
training device (GShard, Switch); generate with moe_capacity_factor = 0.

The aux loss of the latest forward is kept in `MoE.aux_loss`; `aux_loss(model)` sums them, and the
training loop adds train.aux_loss_weight * aux_loss(model) to the loss: forward needs no output flag.
Parameter names: router.weight (E, D), experts.{e}.<the dense FFN's names> (as qkv.ref.moe).
"""
from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from qkv.nn.ffn import FFNS


class MoE(nn.Module):
    def __init__(self, d_model: int, d_ff: int, *, experts: int, top_k: int, capacity_factor: float = 0.0,
                 ffn: str = "mlp", activation: str, bias: bool, dropout: float = 0.0):
        super().__init__()
        self.top_k, self.capacity_factor = top_k, capacity_factor
        self.router = nn.Linear(d_model, experts, bias=False)  # W_r (E, D)
        self.experts = nn.ModuleList(
            FFNS.get(ffn)(d_model, d_ff, activation=activation, bias=bias, dropout=dropout) for _ in range(experts))
        self.aux_loss = torch.zeros(())  # of the latest forward

    def forward(self, x: Tensor) -> Tensor:  # (B, T, D) -> (B, T, D)
        tokens = x.reshape(-1, x.shape[-1])  # (N, D)
        logits = self.router(tokens).to(torch.promote_types(x.dtype, torch.float32))  # softmax in fp32 (N, E)
        top_logits, top = logits.topk(self.top_k, dim=-1)  # (N, k), largest first
        gates = top_logits.softmax(-1)  # g (N, k)
        kept = self.within_capacity(top.view(*x.shape[:-1], self.top_k))  # (N, k) bool
        out = torch.zeros_like(tokens)
        for expert, rows, gate in dispatch(top, gates, kept, self.experts):
            out = out.index_add(0, rows, gate[:, None].to(x.dtype) * expert(tokens[rows]))
        self.aux_loss = load_balancing_loss(logits.softmax(-1), top, len(self.experts))
        return out.view_as(x)

    def within_capacity(self, top: Tensor) -> Tensor:
        """Routes each expert accepts, top (B, T, k) -> (B*T, k) bool: at most ceil(c N k / E) per expert,
        in (position, row, choice) order."""
        if not self.capacity_factor:
            return torch.ones_like(top, dtype=torch.bool).view(-1, self.top_k)
        B, T, k = top.shape
        E = len(self.experts)
        capacity = math.ceil(self.capacity_factor * B * T * k / E)
        order = top.transpose(0, 1).reshape(-1)  # position-major queue of routes   (T B k,)
        one_hot = torch.nn.functional.one_hot(order, E)  # (T B k, E)
        rank = (one_hot.cumsum(0) * one_hot).sum(-1) - 1  # the route's place in its expert's queue
        return (rank < capacity).view(T, B, k).transpose(0, 1).reshape(B * T, k)


def dispatch(top: Tensor, gates: Tensor, kept: Tensor, experts: nn.ModuleList):
    """(expert, its rows, their gates) for each expert that has routes, as an MoE runtime groups them: the kept
    routes (N k) sorted by expert once (stable: a token's rows stay in order), their counts read in one transfer,
    then each expert's contiguous run of rows. Work and host syncs follow the experts used, not E: a decoding
    step of a 128-expert top-8 layer runs 8 experts, where a loop asking each expert for its tokens asks 128
    times (benchmarks/moe_dispatch.py)."""
    k = top.shape[-1]
    routes = torch.nonzero(kept.reshape(-1), as_tuple=True)[0]  # kept routes, token-major   (R,)
    chosen = top.reshape(-1)[routes]
    order = torch.argsort(chosen, stable=True)
    routes, chosen = routes[order], chosen[order]
    counts = torch.bincount(chosen, minlength=len(experts)).tolist()  # the one transfer to the host
    start = 0
    for expert, count in zip(experts, counts):
        if count:
            run = routes[start:start + count]
            yield expert, run // k, gates.reshape(-1)[run]
        start += count


def load_balancing_loss(probs: Tensor, top: Tensor, experts: int) -> Tensor:
    """E * sum_e f_e P_e: f_e the share of routes to e (counted, no gradient), P_e = mean_n p_ne."""
    routed = torch.bincount(top.reshape(-1), minlength=experts).to(probs.dtype) / top.numel()  # f_e (E,)
    return experts * (routed * probs.mean(0)).sum()


def aux_loss(model: nn.Module) -> Tensor:
    """The sum of every MoE layer's load-balancing loss from the latest forward (0 without MoE)."""
    losses = [m.aux_loss for m in model.modules() if isinstance(m, MoE)]
    return torch.stack(losses).sum() if losses else torch.zeros(())
