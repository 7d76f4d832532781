"""Mixture-of-Experts FFN with top-k gating, forward and backward (note 002 "混合专家"; 000 LLM §6.3 aux loss).

    p = softmax(x W_r^T)               router probabilities over E experts   (N, E)
    top = the k largest p per token;   g = p[top] / sum p[top] = softmax(logits[top])
    y = sum_{e in top} g_e FFN_e(x)
    aux = E * sum_e f_e P_e            (Switch Transformer load balance; f_e = share of the N*k routes that
                                        go to e, not differentiable; P_e = mean_n p_ne)
Backward: dFFN_e(x) = g_e dy for the tokens routed to e; dg_e = dy . FFN_e(x); the gate softmax over the
chosen logits gives dlogit = g * (dg - sum g dg) (000 LLM §3.3.3 step 3, the same row rule); unchosen
logits receive only the aux term, through the full softmax. Parameter names: router.weight (E, D),
experts.{e}.<the dense FFN's names>. The gradient through the choice of `top` itself is zero (piecewise
constant), as in every top-k router.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

from qkv.ref.ffn import FFNS
from qkv.ref.functional import Grads, linear_backward, linear_forward, scope, softmax, softmax_backward


class MoECache(NamedTuple):
    shape: tuple
    router: tuple  # the router linear's cache
    probs: np.ndarray  # p (N, E)
    top: np.ndarray  # (N, k)
    gates: np.ndarray  # g (N, k)
    experts: list  # per expert: (rows, slot, FFN_e output, FFN_e cache)
    routed: np.ndarray  # f_e (E,)
    ffn: str
    aux: float  # the load-balancing loss of this forward
    aux_weight: float  # its weight in the total loss, which scales its gradient


def route(logits: np.ndarray, top_k: int):
    """Indices of the top_k experts per token (largest first) and their renormalised gates. (N, k) each."""
    top = np.argsort(-logits, axis=-1, kind="stable")[:, :top_k]
    gates = softmax(np.take_along_axis(logits, top, axis=-1))
    return top, gates


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
                aux_weight: float = 0.0, capacity_factor: float = 0.0):
    """A dropped route (capacity_factor > 0) adds nothing and gets no gradient; f_e counts every route."""
    shape = x.shape
    tokens = x.reshape(-1, shape[-1])  # (N, D)
    logits, crouter = linear_forward(tokens, params["router.weight"])  # (N, E)
    probs = softmax(logits)
    top, gates = route(logits, top_k)
    kept = within_capacity(top, shape, experts, capacity_factor)  # (N, k)
    y = np.zeros_like(tokens)
    expert_caches = []
    for e in range(experts):
        rows, slot = np.nonzero((top == e) & kept)  # the tokens routed to e, and which of their k choices it is
        out, cache = FFNS.get(ffn).forward(scope(params, f"experts.{e}"), tokens[rows], activation)
        y[rows] += gates[rows, slot, None] * out
        expert_caches.append((rows, slot, out, cache))
    routed = np.bincount(top.reshape(-1), minlength=experts) / top.size  # f_e
    aux = experts * float((routed * probs.mean(axis=0)).sum())
    return y.reshape(shape), MoECache(shape, crouter, probs, top, gates, expert_caches, routed, ffn, aux, aux_weight)


def moe_backward(dy: np.ndarray, cache, grads: Grads) -> np.ndarray:
    shape, crouter, probs, top, gates, expert_caches, routed, ffn, _, aux_weight = cache
    experts = len(expert_caches)
    dy = dy.reshape(-1, shape[-1])  # (N, D)
    dtokens = np.zeros_like(dy)
    dgates = np.zeros_like(gates)  # (N, k)
    for e, (rows, slot, out, ecache) in enumerate(expert_caches):
        dgates[rows, slot] = (dy[rows] * out).sum(axis=-1)  # dg_e = dy . FFN_e(x)
        dx = FFNS.get(ffn).backward(gates[rows, slot, None] * dy[rows], ecache,
                                    grads.scope(f"experts.{e}"))  # dFFN_e = g_e dy
        np.add.at(dtokens, rows, dx)
    dlogits = np.zeros_like(probs)
    np.put_along_axis(dlogits, top, softmax_backward(dgates, gates), axis=-1)  # the gate softmax's row rule
    n = probs.shape[0]
    daux_probs = np.broadcast_to(aux_weight * experts * routed / n, probs.shape)  # d(aux)/dp_ne = E f_e / N
    dlogits += softmax_backward(daux_probs, probs)
    dx = linear_backward(dlogits, crouter, grads.scope("router"))
    return (dtokens + dx).reshape(shape)
