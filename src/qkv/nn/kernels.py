"""Attention kernels: one signature for all (STYLE.md 4).

    kernel(q, k, v, *, mask, causal, bias, scale, dropout=0.0, value_bias=None) -> out
    q: (B, H, T, Dh); k, v: (B, H, S, Dh) (key/value heads already repeated for GQA/MQA)
    mask: (B, 1, T, S) bool, True where attention is allowed, or None
    causal: apply the causal triangle (bottom-right aligned) when mask is None
    bias: additive score bias broadcastable to (B, H, T, S), or None
    value_bias: a `RelativeValues` term added to the weighted values (Shaw et al.'s a^V_ij), or None
    out: (B, H, T, Dh)

Each kernel is registered with what qkv needs to know about it, in one `KernelSpec`: the function, the
explicit weights it computes, whether it takes a window, how far back a causal query reads (for a rolling
KV cache), whether it sees every allowed key (cross-attention needs that), whether it is the exact softmax
of its pattern, and whether it keeps the (T, S) probabilities (the memory calculator's model).

`naive` writes note 000 §2.1 / §8.2 out: softmax(Q K^T / sqrt(d_k) + M) V; every other kernel is tested
against it (the sparse ones with their pattern in the mask). Kernels with a parameter (the window of the
sparse kinds) take it as a keyword and are bound once by `kernel_for(name, window=...)`, so every call
site sees the signature above. Queries are the last T of S key columns (a KV cache holds the first
S - T): query t sits at column S - T + t, and every pattern is a function of (query column, key column).
"""
from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from qkv.nn.masks import causal_mask
from qkv.registry import Registry

Kernel = Callable[..., Tensor]


@dataclass(frozen=True)
class KernelSpec:
    """One attention kernel and its facts: the registry entry of model.attention."""

    fn: Kernel  # the kernel (module docstring's signature, plus `window=` when `windowed`)
    # weights(q, k, *, mask, causal, bias, scale[, window]) -> A (B, H, T, S): the explicit attention matrix
    # the kernel computes (naive with its pattern, or linear attention's normalised kernel); record_attention
    # and the tests use it
    weights: Callable[..., Tensor]
    windowed: bool = False  # takes model.window, which must then be >= 1
    # causal query i reads no key before column i - reach(window): a rolling KV cache of reach(window)
    # columns serves it (qkv.nn.cache); None: it may read every column
    reach: Callable[[int], int] | None = None
    full: bool = True  # softmax over every allowed key; cross-attention always uses a full kernel
    exact: bool = True  # the exact softmax of its pattern (False: an approximation, linear attention)
    keeps_probabilities: bool = True  # stores the (B, H, T, S) probabilities for the backward (qkv calc)
    keeps_value_buckets: bool = True  # stores a value term's per-row buckets (B, H, T, R) (qkv calc)
    value_term_kernel: str | None = None  # the kernel that runs in its place when a value term is given
    # score_pairs(T, S, window) -> how many (query, key) scores the kernel computes per head (qkv calc's
    # FLOPs); None: all T x S
    score_pairs: Callable[[int, int, int], int] | None = None
    # causal_pairs(T, S) -> the scores it computes under the plain causal triangle when it skips what the
    # triangle hides (flash's tiles); None: as score_pairs
    causal_pairs: Callable[[int, int], int] | None = None
    # backward_scores(T, S) -> the fp32 scores per head its backward forms at once beside what it saved (qkv
    # calc's peak: naive's dA and dS, flash's one tile); None: none counted
    backward_scores: Callable[[int, int], int] | None = None
    # copied_rows(T, S, window) -> Dh-wide rows of q, k, v copies (gathered bands, regrouped classes) the kernel
    # saves for the backward per head, beyond the layer's own Q, K, V (qkv calc's memory); None: none
    copied_rows: Callable[[int, int, int], int] | None = None


KERNELS: Registry[KernelSpec] = Registry("attention kernel")


@dataclass(frozen=True)
class RelativeValues:
    """A value term: out_i += sum_j A_ij table[index_ij] (Shaw et al. 2018, z_i = sum_j a_ij (v_j + a^V_ij)).

    It is linear in the weights, so a tiled kernel adds it tile by tile: the weights of a tile are summed
    into R buckets (one per table row) and the buckets are multiplied by the table once.
    """

    index: Tensor  # (B, T, S) long: the table row key j adds to query i
    table: Tensor  # (R, Dh)

    def buckets(self, weights: Tensor, index: Tensor) -> Tensor:
        """sum_j weights[..., j] [index[..., j] = r] for every row r. weights (B, H, .., s), index (B, 1, .., s)."""
        out = weights.new_zeros(*weights.shape[:-1], self.table.shape[0])  # (B, H, .., R)
        return out.scatter_add_(-1, index.expand_as(weights), weights)

    def term(self, weights: Tensor, index: Tensor) -> Tensor:  # (B, H, .., Dh)
        return self.buckets(weights, index) @ self.table.to(weights.dtype)


def wide_dtype(dtype: torch.dtype) -> torch.dtype:
    """Softmax statistics in at least fp32: exp of bf16 scores loses most bits (fp64 stays fp64)."""
    return torch.promote_types(dtype, torch.float32)


def attention_weights(q: Tensor, k: Tensor, *, mask: Tensor | None, causal: bool,
                      bias: Tensor | None, scale: float,
                      on_scores: Callable[[Tensor], Tensor] | None = None, softcap: float = 0.0,
                      sinks: Tensor | None = None) -> Tensor:
    """A = softmax(Q K^T * scale + bias + M), M = -inf where masked (note 000 §2.1.3, §8.2). (B, H, T, S)

    `on_scores` sees the scores S = Q K^T * scale + bias + M before the softmax and may replace them (the
    `attn.scores` hook point: setting an entry to -inf removes that key from the query's softmax). `softcap`
    c > 0: the scores are c tanh(S / c) before the mask (Gemma 2's bound on the logits). `sinks` (H,): each head's
    learnt logit joins its softmax's denominator and takes no value (gpt-oss's attention sinks): A's rows then sum
    to less than 1, a query may attend to nothing."""
    T, S = q.shape[-2], k.shape[-2]
    scores = (q @ k.transpose(-2, -1)).to(wide_dtype(q.dtype)) * scale  # (B, H, T, S)
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    if bias is not None:
        scores = scores + bias
    if mask is None and causal:
        mask = causal_mask(T, S, q.device)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    if on_scores is not None:
        scores = on_scores(scores)
    if sinks is not None:
        column = sinks.to(scores.dtype).view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
        return torch.cat((scores, column), dim=-1).softmax(dim=-1)[..., :-1]
    return scores.softmax(dim=-1)


def weighted_values(weights: Tensor, v: Tensor, value_bias: RelativeValues | None, dropout: float) -> Tensor:
    """out = dropout(A) V (+ the value term): the last step of every kernel that forms A. (B, H, T, Dh)"""
    weights = F.dropout(weights, p=dropout) if dropout else weights
    out = weights.to(v.dtype) @ v
    if value_bias is not None:
        out = out + value_bias.term(weights, value_bias.index[:, None]).to(v.dtype)
    return out


def naive(q: Tensor, k: Tensor, v: Tensor, *, mask: Tensor | None, causal: bool, bias: Tensor | None,
          scale: float, dropout: float = 0.0, value_bias: RelativeValues | None = None) -> Tensor:
    weights = attention_weights(q, k, mask=mask, causal=causal, bias=bias, scale=scale)
    return weighted_values(weights, v, value_bias, dropout)  # (B, H, T, Dh)


def sdpa(q: Tensor, k: Tensor, v: Tensor, *, mask: Tensor | None, causal: bool, bias: Tensor | None,
         scale: float, dropout: float = 0.0, value_bias: RelativeValues | None = None) -> Tensor:
    """torch's fused scaled_dot_product_attention (flash / memory-efficient kernels where available).
    A value term needs the weights, which the fused kernel never forms: then it is the naive kernel.
    On a CPU, bf16 and fp16 q, k, v are attended in fp32 and the result rounded back: torch's CPU kernels are
    faster in fp32 (the default job's layer, 8 x 4 heads x 256 x 32, forward and backward: 7.1-8.8 ms against
    10.1-11.7 in bf16 on an AMD EPYC with avx512_bf16) and the scores and weights are not rounded to 8 bits."""
    groups = q.shape[1] // k.shape[1]  # grouped-query attention: k and v come with H / groups heads
    if value_bias is not None:
        k, v = (k, v) if groups == 1 else (k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1))
        return naive(q, k, v, mask=mask, causal=causal, bias=bias, scale=scale, dropout=dropout,
                     value_bias=value_bias)
    T, S = q.shape[-2], k.shape[-2]
    is_causal = causal and mask is None and bias is None and T == S  # torch aligns is_causal top-left
    if causal and mask is None and not is_causal and T > 1:
        mask = causal_mask(T, S, q.device)
    dtype, wide = q.dtype, False
    if q.device.type == "cpu" and q.dtype != torch.float64:  # bf16 / fp16 inputs or autocast's: in fp32 (above)
        autocasting = torch.is_autocast_enabled("cpu")
        wide = autocasting or any(t.dtype in (torch.bfloat16, torch.float16) for t in (q, k, v))
        dtype = torch.get_autocast_dtype("cpu") if autocasting else dtype  # what autocast's kernel returns
    if wide:
        q, k, v = q.float(), k.float(), v.float()
    attn_mask = mask
    if bias is not None:
        attn_mask = bias.to(q.dtype) if mask is None else bias.to(q.dtype).masked_fill(~mask, float("-inf"))
    grouped = {"enable_gqa": True} if groups > 1 else {}  # each group of heads reads its K/V: no copies
    with torch.autocast(q.device.type, enabled=False) if wide else contextlib.nullcontext():
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=dropout,
                                             is_causal=is_causal, scale=scale, **grouped)
    return out.to(dtype)


# sdpa takes K and V with fewer heads than Q (torch >= 2.5's enable_gqa): Attention hands them over unrepeated,
# which spares a decoding step the copy of every cached K and V per layer (twice as fast at 600 cached tokens)
sdpa.grouped_kv = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 5)


# ---------------------------------------------------------------------------------------- binding, recording


def kernel_for(name: str, *, window: int = 0) -> Kernel:
    """The kernel `name`, with its parameter (`window`) bound when it takes one: one signature after."""
    spec = KERNELS.get(name)
    return functools.partial(spec.fn, window=window) if spec.windowed else spec.fn


def weights_for(name: str, *, window: int = 0) -> Callable[..., Tensor]:
    """The explicit (B, H, T, S) attention matrix kernel `name` computes, with its window bound."""
    spec = KERNELS.get(name)
    return functools.partial(spec.weights, window=window) if spec.windowed else spec.weights


def recording_kernel(weights: Callable[..., Tensor], records: list, slot: int) -> Kernel:
    """A kernel computing `weights` explicitly and storing them (detached) in records[slot]."""
    def kernel(q, k, v, *, mask, causal, bias, scale, dropout=0.0, value_bias=None):
        attn = weights(q, k, mask=mask, causal=causal, bias=bias, scale=scale)  # (B, H, T, S)
        records[slot] = attn.detach()
        return weighted_values(attn, v, value_bias, dropout)
    return kernel


KERNELS.register("naive")(KernelSpec(fn=naive, weights=attention_weights,
                                     backward_scores=lambda T, S: 2 * T * S))  # dA and dS
KERNELS.register("sdpa")(KernelSpec(fn=sdpa, weights=attention_weights, keeps_probabilities=False,
                                    value_term_kernel="naive"))
