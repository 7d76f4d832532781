"""Mixture-of-Experts FFN with top-k routing, forward and backward (note 002 "混合专家"; 000 LLM §6.3 aux loss),
routed as the open families route (qkv.nn.moe; docs/derivations/moe.md):

    l = x W_r^T;   s = softmax(l) or sigmoid(l)          scores (N, E)
    top = the k largest s + b (within the best groups)   b: a bias that only chooses (no gradient)
    w = s[top];  g = c w / sum w  (normalize)  or  c w    c: the routed scale
    y = sum_{e in top} g_e FFN_e(x) + FFN_shared(x)
    aux = E * sum_e f_e P_e            (Switch Transformer load balance; f_e = share of the N*k routes that
                                        go to e, not differentiable; P_e = mean_n p_ne, p = s for softmax,
                                        s / sum_e s for sigmoid)
Backward, row by row (docs/derivations/moe.md): dFFN_e(x) = g_e dy for the tokens routed to e;
dg_e = dy . FFN_e(x); dw = c dg, and through the normalisation dw_i <- (dw_i - sum_j dw_j g_j / c) / sum w
(the quotient rule: g / c = w / sum w); the chosen scores get dw, the others nothing from the gates; the aux
term adds E f_e / N to dp (through p = s / sum s for sigmoid, the same quotient rule); then
dl = s (ds - sum s ds) for softmax (000 LLM §3.3.3 step 3), dl = s (1 - s) ds for sigmoid. The gradient through
the choice of `top` itself is zero (piecewise constant), as in every top-k router; b gets none.
Parameter names: router.weight (E, D), router_bias (E,), experts.{e}.<the dense FFN's names>, shared.<...>.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

from qkv.ref.ffn import FFNS
from qkv.ref.functional import Grads, linear_backward, linear_forward, scope, softmax, softmax_backward


class Routing(NamedTuple):
    """qkv.nn.moe.Routing's fields, for the reference engine."""

    scoring: str = "softmax"
    normalize: bool = True
    scale: float = 1.0
    groups: int = 0
    group_top_k: int = 0


class MoECache(NamedTuple):
    shape: tuple
    router: tuple  # the router linear's cache
    probs: np.ndarray  # p (N, E): the distribution the balance loss reads
    top: np.ndarray  # (N, k)
    gates: np.ndarray  # g (N, k)
    experts: list  # per expert: (rows, slot, FFN_e output, FFN_e cache)
    routed: np.ndarray  # f_e (E,)
    ffn: str
    aux: float  # the load-balancing loss of this forward
    aux_weight: float  # its weight in the total loss, which scales its gradient
    scores: np.ndarray = None  # s (N, E)
    routing: Routing = Routing()
    shared: tuple | None = None  # the shared FFN's cache, or None


def scores_of(logits: np.ndarray, routing: Routing) -> np.ndarray:
    return softmax(logits) if routing.scoring == "softmax" else 1.0 / (1.0 + np.exp(-logits))


def route(scores: np.ndarray, top_k: int, routing: Routing = Routing(), bias: np.ndarray | None = None):
    """Indices of the top_k experts per token (largest first) and their gates, (N, k) each (as
    qkv.nn.moe.choose)."""
    ranked = scores if bias is None else scores + bias
    if routing.groups > 1:
        N, E = ranked.shape
        grouped = ranked.reshape(N, routing.groups, E // routing.groups)
        best = -np.sort(-grouped, axis=-1)
        rank = best[..., :2].sum(-1) if routing.scoring == "sigmoid" else best[..., 0]  # (N, G)
        keep = np.argsort(-rank, axis=-1, kind="stable")[:, :routing.group_top_k]
        allowed = np.zeros(rank.shape, dtype=bool)
        np.put_along_axis(allowed, keep, True, axis=-1)
        ranked = np.where(allowed[..., None], grouped, -np.inf).reshape(N, E)
    top = np.argsort(-ranked, axis=-1, kind="stable")[:, :top_k]
    gates = np.take_along_axis(scores, top, axis=-1)
    if routing.normalize:
        gates = gates / gates.sum(-1, keepdims=True)
    return top, routing.scale * gates


def balance_probs(scores: np.ndarray, routing: Routing) -> np.ndarray:
    return scores if routing.scoring == "softmax" else scores / scores.sum(-1, keepdims=True)


def within_capacity(top: np.ndarray, shape: tuple, experts: int, capacity_factor: float) -> np.ndarray:
    """The routes each expert accepts, (N, k) bool (as qkv.nn.moe.MoE.within_capacity): at most
    ceil(c N k / E) per expert, served position-major (every row's position 0, then position 1, ...; a
    token's first choice before its second), so no token is dropped because of a later one."""
    if not capacity_factor:
        return np.ones(top.shape, dtype=bool)
    B, T, k = shape[0], top.shape[0] // shape[0], top.shape[1]
    capacity = math.ceil(capacity_factor * B * T * k / experts)
    order = top.reshape(B, T, k).transpose(1, 0, 2).reshape(-1)  # the queue of routes   (T B k,)
    onehot = np.eye(experts, dtype=np.int64)[order]  # (T B k, E)
    rank = (np.cumsum(onehot, axis=0) * onehot).sum(axis=-1) - 1  # each route's place in its expert's queue
    return (rank < capacity).reshape(T, B, k).transpose(1, 0, 2).reshape(B * T, k)


def moe_forward(params: dict, x: np.ndarray, *, ffn: str, activation: str, experts: int, top_k: int,
                aux_weight: float = 0.0, capacity_factor: float = 0.0, routing: Routing = Routing()):
    """A dropped route (capacity_factor > 0) adds nothing and gets no gradient; f_e counts every route."""
    shape = x.shape
    tokens = x.reshape(-1, shape[-1])  # (N, D)
    logits, crouter = linear_forward(tokens, **scope(params, "router"))  # (N, E) (gpt-oss: with a bias)
    scores = scores_of(logits, routing)
    top, gates = route(scores, top_k, routing, params.get("router_bias"))
    kept = within_capacity(top, shape, experts, capacity_factor)  # (N, k)
    y = np.zeros_like(tokens)
    expert_caches = []
    for e in range(experts):
        rows, slot = np.nonzero((top == e) & kept)  # the tokens routed to e, and which of their k choices it is
        out, cache = FFNS.get(ffn).forward(scope(params, f"experts.{e}"), tokens[rows], activation)
        y[rows] += gates[rows, slot, None] * out
        expert_caches.append((rows, slot, out, cache))
    cshared = None
    if "shared.down_proj.weight" in params:  # every token's shared expert (DeepSeek)
        out, cshared = FFNS.get(ffn).forward(scope(params, "shared"), tokens, activation)
        y = y + out
    probs = balance_probs(scores, routing)
    routed = np.bincount(top.reshape(-1), minlength=experts) / top.size  # f_e
    aux = experts * float((routed * probs.mean(axis=0)).sum())
    return y.reshape(shape), MoECache(shape, crouter, probs, top, gates, expert_caches, routed, ffn, aux, aux_weight,
                                      scores, routing, cshared)


def moe_backward(dy: np.ndarray, cache, grads: Grads) -> np.ndarray:
    shape, crouter, probs, top, gates, expert_caches, routed, ffn, _, aux_weight, scores, routing, cshared = cache
    experts = len(expert_caches)
    dy = dy.reshape(-1, shape[-1])  # (N, D)
    dtokens = np.zeros_like(dy)
    dgates = np.zeros_like(gates)  # (N, k)
    for e, (rows, slot, out, ecache) in enumerate(expert_caches):
        dgates[rows, slot] = (dy[rows] * out).sum(axis=-1)  # dg_e = dy . FFN_e(x)
        dx = FFNS.get(ffn).backward(gates[rows, slot, None] * dy[rows], ecache,
                                    grads.scope(f"experts.{e}"))  # dFFN_e = g_e dy
        np.add.at(dtokens, rows, dx)
    if cshared is not None:
        dtokens += FFNS.get(ffn).backward(dy, cshared, grads.scope("shared"))
    dw = routing.scale * dgates  # g = c w': dw' = c dg
    if routing.normalize:  # w' = w / sum w: dw_i = (dw'_i - sum_j dw'_j w'_j) / sum w
        chosen = np.take_along_axis(scores, top, axis=-1)
        dw = (dw - (dw * gates / routing.scale).sum(-1, keepdims=True)) / chosen.sum(-1, keepdims=True)
    dscores = np.zeros_like(scores)
    np.put_along_axis(dscores, top, dw, axis=-1)  # (top holds distinct experts per row)
    n = probs.shape[0]
    dprobs = np.broadcast_to(aux_weight * experts * routed / n, probs.shape)  # d(aux)/dp_ne = E f_e / N
    if routing.scoring == "softmax":  # p = s
        dscores = dscores + dprobs
        dlogits = softmax_backward(dscores, scores)
    else:  # p = s / sum s (the quotient rule), s = sigmoid(l): ds/dl = s (1 - s)
        total = scores.sum(-1, keepdims=True)
        dscores = dscores + (dprobs - (dprobs * probs).sum(-1, keepdims=True)) / total
        dlogits = dscores * scores * (1.0 - scores)
    dx = linear_backward(dlogits, crouter, grads.scope("router"))
    return (dtokens + dx).reshape(shape)
