"""Mixture-of-Experts FFN with top-k routing and a load-balancing loss (note 002 "混合专家"; note 000 LLM
§6.3 auxiliary losses; Shazeer et al. 2017, Switch Transformer (Fedus et al. 2022), GShard capacity), routed
as each open family routes (docs/derivations/moe.md):

    l = x W_r^T                          router logits over E experts                        (N, E)
    s = softmax(l)  or  sigmoid(l)       scores (Routing.scoring; sigmoid: DeepSeek-V3)
    top = the k largest s + b            b: a per-expert bias used only to choose (DeepSeek-V3's
                                         auxiliary-loss-free balancing; 0 elsewhere), within the
                                         group_top_k best of G groups where G > 1 (DeepSeek-V2/V3)
    g = s[top] / sum s[top]  (normalize) or s[top];  g <- scale g   the gates                 (N, k)
    y = sum_{e in top, kept} g_e FFN_e(x)  +  FFN_shared(x)          (shared experts: DeepSeek)
    aux = E * sum_e f_e P_e              f_e = share of the N k routes that go to e (no gradient),
                                         P_e = mean_n p_ne, p = s (softmax) or s / sum_e s (sigmoid)

Softmax with normalize is softmax over the top-k logits (Mixtral, gpt-oss, note 002's gate: the scores'
shared denominator cancels); Qwen3-MoE normalises when its config's norm_topk_prob says so; OLMoE does not.
Note 002's sketch averages the chosen experts' outputs with weight 1/k and no gate, so the router gets no
gradient; qkv weighs them by the gates (docs/DEVIATIONS.md), as qkv.ref.moe does.
Capacity (model.moe_capacity_factor = c > 0): each expert takes at most ceil(c N k / E) routes of a forward
call, served by position (every row's position 0, then position 1, ...; a token's first choice before its
second), so a token is never dropped because of a later one: the decoder stays causal. A dropped route adds
nothing; a token whose every route is dropped leaves the FFN as 0 and the block passes it on through the
residual alone. Capacity is per call (N tokens), so a KV-cache step (N = B) is not the full pass: it is a
training device (GShard, Switch); generate with moe_capacity_factor = 0.

The aux loss of the latest forward is kept in `MoE.aux_loss`; `aux_loss(model)` sums them, and the
training loop adds train.aux_loss_weight * aux_loss(model) to the loss: forward needs no output flag. Beside it
the router z-loss (ST-MoE, Zoph et al. 2022) z = mean_n (logsumexp_e l_ne)^2, `z_loss(model)`, weighted by
train.router_z_loss_weight: it keeps the router logits small, where bf16 rounds them less. DeepSeek-V3's
auxiliary-loss-free balancing moves the choosing bias instead of adding a loss: training forwards count each
expert's routes (`MoE.routed`), and after each optimizer step `nudge_choice_bias(model, gamma)` sets
b_e += gamma sign(mean_e load - load_e) (Wang et al. 2024): an overloaded expert is chosen less, without a
gradient that pulls against the language loss.
Parameter names: router.weight (E, D), experts.{e}.<the dense FFN's names> (as qkv.ref.moe), shared.<the
dense FFN's names>; the choice bias is the buffer router_bias (E,).
Hook points (qkv.nn.hookpoints): `router` the scores s (B, T, E), before the choice (a replacement routes by it);
`gates` (B, T, E), each token's gate of every expert, 0 for those it did not choose (formed only when hooked; a
replacement routes each token to the k largest of its row, with those entries as gates); `post` the layer's
output (B, T, D).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from qkv.nn.ffn import FFNS
from qkv.nn.hookpoints import point, wants


@dataclass(frozen=True)
class Routing:
    """How a family turns router logits into k experts and their gates (module docstring)."""

    scoring: str = "softmax"  # softmax | sigmoid
    normalize: bool = True  # the k chosen scores divided by their sum
    scale: float = 1.0  # the gates' factor (DeepSeek's routed_scaling_factor)
    groups: int = 0  # G > 1: choose within the group_top_k best groups of E / G experts
    group_top_k: int = 0


def route(logits: Tensor, routing: Routing, top_k: int, bias: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """(top (N, k), gates (N, k), scores (N, E)) of router logits (N, E) in fp32."""
    scores = scores_of(logits, routing)
    return *choose(scores, routing, top_k, bias), scores


def scores_of(logits: Tensor, routing: Routing) -> Tensor:
    return logits.softmax(-1) if routing.scoring == "softmax" else logits.sigmoid()


def choose(scores: Tensor, routing: Routing, top_k: int, bias: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """(top (N, k), gates (N, k)) of scores (N, E): the k largest s + b (within the best groups), their s as
    gates, normalised and scaled as `routing` says."""
    ranked = scores if bias is None else scores + bias
    if routing.groups > 1:
        ranked = within_groups(ranked, routing.groups, routing.group_top_k, best_two=routing.scoring == "sigmoid")
    top = ranked.topk(top_k, dim=-1).indices  # (N, k), largest first
    gates = scores.gather(-1, top)
    if routing.normalize:
        gates = gates / gates.sum(-1, keepdim=True)
    return top, gates * routing.scale if routing.scale != 1.0 else gates


def within_groups(choose: Tensor, groups: int, keep: int, best_two: bool) -> Tensor:
    """Group-limited routing: each token's E experts in `groups` runs of E / G, ranked by their best score
    (DeepSeek-V2) or the sum of their two best (DeepSeek-V3, `best_two`); the experts outside the `keep` best
    groups get -inf, so the top k come from those (DeepSeek's reference code; transformers writes 0 there, the
    same choice while every biased score is positive)."""
    N, E = choose.shape
    grouped = choose.view(N, groups, E // groups)
    rank = grouped.topk(2, dim=-1).values.sum(-1) if best_two else grouped.amax(-1)  # (N, G)
    chosen = torch.zeros_like(rank, dtype=torch.bool).scatter_(1, rank.topk(keep, dim=-1).indices, True)
    return grouped.masked_fill(~chosen[..., None], float("-inf")).view(N, E)


def balance_probs(scores: Tensor, routing: Routing) -> Tensor:
    """p, each token's scores as a distribution over the experts: P_e = mean_n p_ne of the balance loss."""
    return scores if routing.scoring == "softmax" else scores / scores.sum(-1, keepdim=True)


class MoE(nn.Module):
    hook_points = ("router", "gates", "post")  # qkv.nn.hookpoints

    def __init__(self, d_model: int, d_ff: int, *, experts: int, top_k: int, capacity_factor: float = 0.0,
                 ffn: str = "mlp", activation: str, bias: bool, dropout: float = 0.0,
                 routing: Routing = Routing(), choice_bias: bool = False, shared_d_ff: int = 0,
                 router_bias: bool = False):
        super().__init__()
        self.top_k, self.capacity_factor, self.routing = top_k, capacity_factor, routing
        self.router = nn.Linear(d_model, experts, bias=router_bias)  # W_r (E, D) [+ b_r: gpt-oss's logits' bias]
        if choice_bias:  # b (E,): chooses, never weighs; moved by the load, not by gradients (qkv.train)
            self.register_buffer("router_bias", torch.zeros(experts))
        else:
            self.router_bias = None
        self.experts = nn.ModuleList(
            FFNS.get(ffn)(d_model, d_ff, activation=activation, bias=bias, dropout=dropout) for _ in range(experts))
        self.shared = (FFNS.get(ffn)(d_model, shared_d_ff, activation=activation, bias=bias, dropout=dropout)
                       if shared_d_ff else None)
        self.aux_loss = self.z_loss = torch.zeros(())  # of the latest forward
        self.routed: Tensor | None = None  # each expert's routes counted by training forwards (choice bias)

    def forward(self, x: Tensor) -> Tensor:  # (B, T, D) -> (B, T, D)
        tokens = x.reshape(-1, x.shape[-1])  # (N, D)
        logits = self.router(tokens).to(torch.promote_types(x.dtype, torch.float32))  # routed in fp32 (N, E)
        scores = scores_of(logits, self.routing)
        scores = point(self, "router", scores.view(*x.shape[:-1], -1)).view_as(scores)
        top, gates = choose(scores, self.routing, self.top_k, self.router_bias)
        if wants(self, "gates"):
            top, gates = self.hooked_gates(top, gates, x.shape)
        kept = self.within_capacity(top.view(*x.shape[:-1], self.top_k))  # (N, k) bool
        out = self.routed_output(tokens, top, gates, kept)
        if self.shared is not None:
            out = out + self.shared(tokens)
        self.aux_loss = load_balancing_loss(balance_probs(scores, self.routing), top, len(self.experts))
        self.z_loss = logits.logsumexp(-1).square().mean()
        if self.training and self.router_bias is not None:
            with torch.no_grad():
                counts = torch.bincount(top[kept], minlength=len(self.experts)).float()
                self.routed = counts if self.routed is None else self.routed + counts
        return point(self, "post", out.view_as(x))

    def routed_output(self, tokens: Tensor, top: Tensor, gates: Tensor, kept: Tensor) -> Tensor:
        """sum_{e in top, kept} g_e FFN_e(x) for every token (N, D); expert parallel replaces it
        (qkv.parallel.experts: the rows travel to the ranks that hold their experts and back)."""
        out = torch.zeros_like(tokens)
        for expert, rows, gate in dispatch(top, gates, kept, self.experts):
            out = out.index_add(0, rows, gate[:, None].to(tokens.dtype) * expert(tokens[rows]))
        return out

    def hooked_gates(self, top: Tensor, gates: Tensor, shape) -> tuple[Tensor, Tensor]:
        """The gates as a (B, T, E) point; a replacement's k largest entries of each row become the routes."""
        dense = torch.zeros(top.shape[0], len(self.experts), dtype=gates.dtype, device=gates.device)
        dense = point(self, "gates", dense.scatter(1, top, gates).view(*shape[:-1], -1)).reshape(top.shape[0], -1)
        top = dense.topk(self.top_k, dim=-1).indices
        return top, dense.gather(-1, top)

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
    routes, counts = sorted_routes(top, kept, len(experts))
    counts = counts.tolist()  # the one transfer to the host
    start = 0
    for expert, count in zip(experts, counts):
        if count:
            run = routes[start:start + count]
            yield expert, run // k, gates.reshape(-1)[run]
        start += count


def sorted_routes(top: Tensor, kept: Tensor, experts: int) -> tuple[Tensor, Tensor]:
    """(routes (R,), counts (E,)): the kept routes' flat indices into top (N k) sorted by expert, stably (a
    token's rows stay in order; route r is token r // k), and each expert's number of them."""
    routes = torch.nonzero(kept.reshape(-1), as_tuple=True)[0]  # kept routes, token-major   (R,)
    chosen = top.reshape(-1)[routes]
    order = torch.argsort(chosen, stable=True)
    return routes[order], torch.bincount(chosen, minlength=experts)


def load_balancing_loss(probs: Tensor, top: Tensor, experts: int) -> Tensor:
    """E * sum_e f_e P_e: f_e the share of routes to e (counted, no gradient), P_e = mean_n p_ne."""
    routed = torch.bincount(top.reshape(-1), minlength=experts).to(probs.dtype) / top.numel()  # f_e (E,)
    return experts * (routed * probs.mean(0)).sum()


def aux_loss(model: nn.Module) -> Tensor:
    """The sum of every MoE layer's load-balancing loss from the latest forward (0 without MoE)."""
    losses = [m.aux_loss for m in model.modules() if isinstance(m, MoE)]
    return torch.stack(losses).sum() if losses else torch.zeros(())


def z_loss(model: nn.Module) -> Tensor:
    """The sum of every MoE layer's router z-loss from the latest forward (0 without MoE)."""
    losses = [m.z_loss for m in model.modules() if isinstance(m, MoE)]
    return torch.stack(losses).sum() if losses else torch.zeros(())


def nudge_choice_bias(model: nn.Module, rate: float, reduce=None) -> None:
    """After an optimizer step: each MoE layer's choosing bias b_e += rate * sign(mean load - load_e), the load
    counted over the step's training forwards (`reduce(tensor)`: summed over data-parallel ranks), then reset."""
    for module in model.modules():
        if isinstance(module, MoE) and module.router_bias is not None and module.routed is not None:
            load = module.routed if reduce is None else reduce(module.routed)
            with torch.no_grad():
                module.router_bias += rate * torch.sign(load.mean() - load).to(module.router_bias.dtype)
            module.routed = None
