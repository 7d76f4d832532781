"""Whole models: forward lists the layers, backward calls their twins in exactly the reverse order and
accumulates every parameter gradient with += (llm.c's train_gpt2.c; STYLE.md 3).

    H0 = E[x] + P                 embedding (000 LLM §2.1), backward a scatter-add (§3.5)
    H^l = Block^l(H^{l-1})         l = 1..L (§2.2), backward §3.3-§3.4
    logits = LN(H^L) W_out         (§2.3; W_out = W_E when tied), backward §3.2
    loss = CE(logits, y)           (§2.4), backward (P - onehot) / N (§3.1)

`ARCHITECTURES.get(cfg.arch)` gives a `Family(forward, backward)`; only "decoder" exists in qkv.models
today, and the encoder families slot in here when their torch twins land (see qkv.ref.UNSUPPORTED).
"""
from __future__ import annotations

from typing import Callable, NamedTuple

import numpy as np

from qkv.errors import QkvError
from qkv.ref.attention import AttentionContext
from qkv.ref.block import aux_losses, block_backward, block_forward
from qkv.ref.functional import (accumulate, cross_entropy_backward, cross_entropy_forward, embedding_backward,
                                embedding_forward, linear_backward, linear_forward, scope)
from qkv.ref.kernels import KERNELS
from qkv.ref.norms import NORMS
from qkv.ref.positional import POSITIONALS
from qkv.registry import Registry


class Family(NamedTuple):
    forward: Callable  # (params, cfg, input_ids, attention_mask=None, aux_weight=0.0) -> (logits, cache)
    backward: Callable  # (dlogits, cache) -> grads, keyed by the torch parameter names


ARCHITECTURES: Registry[Family] = Registry("architecture")


def check_supported(cfg) -> None:
    if cfg.dropout:
        raise QkvError(f"model.dropout={cfg.dropout}: the reference engine is deterministic; set model.dropout=0")
    if cfg.moe_experts and cfg.moe_capacity_factor:
        raise QkvError("model.moe_capacity_factor: the reference engine routes without a capacity limit; set it to 0")


def positions_and_mask(input_ids: np.ndarray, attention_mask: np.ndarray | None, causal: bool):
    """Positions (B, T) counting real tokens only, and the (B, 1, T, S) mask, as qkv.models.decoder.context:
    key padding AND the causal triangle, OR each query's own column (so no row is empty)."""
    B, T = input_ids.shape
    if attention_mask is None:
        return np.broadcast_to(np.arange(T), (B, T)), None
    positions = np.maximum(np.cumsum(attention_mask.astype(np.int64), axis=-1) - 1, 0)  # (B, T)
    allowed = attention_mask.astype(bool)[:, None, None, :]  # (B, 1, 1, S)
    if causal:
        allowed = allowed & (np.arange(T)[None, :] <= np.arange(T)[:, None])
    return positions, allowed | np.eye(T, dtype=bool)


def make_context(cfg, input_ids, attention_mask, causal: bool) -> AttentionContext:
    positions, mask = positions_and_mask(input_ids, attention_mask, causal)
    return AttentionContext(POSITIONALS.get(cfg.positional)(cfg), positions, positions, mask,
                            causal=causal and mask is None, kernel=KERNELS.get(cfg.attention)(cfg),
                            n_heads=cfg.n_heads)


def embed_forward(params, ctx: AttentionContext, input_ids):
    x, ce = embedding_forward(input_ids, params["tok_emb.weight"])  # E = onehot(X) W_E   (B, T, D)
    x, cp = ctx.positional.embed_forward(scope(params, "positional"), x, ctx.positions)  # H0 = E + P
    return x, (ce, cp, ctx.positional)


def embed_backward(dx, cache, grads):
    ce, cp, positional = cache
    dx, g = positional.embed_backward(dx, cp)  # dP = dH0 (000 LLM §3.5), learned tables only
    accumulate(grads, g, "positional")
    _, g = embedding_backward(dx, ce)  # dW_E = onehot^T dH0: scatter-add (§3.5)
    accumulate(grads, g, "tok_emb")


def head_forward(params, cfg, x):
    """Final norm (Pre-LN stacks only, as qkv.models.build.final_norm) and the output projection."""
    cn = None
    if cfg.norm_placement == "pre":
        x, cn = NORMS.get(cfg.norm).forward(scope(params, "final_norm"), x, cfg.norm_eps)
    out_name = "tok_emb" if cfg.tie_embeddings else "lm_head"  # tied: W_out is W_E itself
    logits, ch = linear_forward(x, params[f"{out_name}.weight"])  # L = H^L W_o   (B, T, V)
    return logits, (cn, ch, out_name, cfg)


def head_backward(dlogits, cache, grads):
    cn, ch, out_name, cfg = cache
    dx, g = linear_backward(dlogits, ch)  # dW_o = (H^L)^T dL, dH^L = dL W_o^T (000 LLM §3.2)
    accumulate(grads, g, out_name)  # tied: this += lands on tok_emb.weight, the embedding adds the rest
    if cn is not None:
        dx, g = NORMS.get(cfg.norm).backward(dx, cn)
        accumulate(grads, g, "final_norm")
    return dx


def decoder_forward(params: dict, cfg, input_ids: np.ndarray, attention_mask=None, aux_weight: float = 0.0):
    """(B, T) token ids -> (B, T, V) logits, as qkv.models.decoder.DecoderLM.forward."""
    check_supported(cfg)
    ctx = make_context(cfg, input_ids, attention_mask, causal=True)
    x, cemb = embed_forward(params, ctx, input_ids)
    cblocks = []
    for i in range(cfg.decoder_layers):
        x, cb = block_forward(scope(params, f"blocks.{i}"), x, cfg, ctx, aux_weight=aux_weight)
        cblocks.append(cb)
    logits, chead = head_forward(params, cfg, x)
    return logits, (cemb, cblocks, chead)


def decoder_backward(dlogits: np.ndarray, cache) -> dict:
    cemb, cblocks, chead = cache
    grads: dict = {}
    dx = head_backward(dlogits, chead, grads)
    for i in reversed(range(len(cblocks))):  # 000 LLM §3.4: layer by layer, l = L..1
        dx, _, g = block_backward(dx, cblocks[i])
        accumulate(grads, g, f"blocks.{i}")
    embed_backward(dx, cemb, grads)
    return grads


ARCHITECTURES.register("decoder")(Family(decoder_forward, decoder_backward))


def aux_loss(cache) -> float:
    """Sum of the blocks' MoE load-balancing losses (unweighted)."""
    return sum(aux_losses(cb) for cb in cache[1])


def forward(params: dict, cfg, *inputs, attention_mask=None, aux_weight: float = 0.0):
    return ARCHITECTURES.get(cfg.arch).forward(params, cfg, *inputs, attention_mask=attention_mask,
                                               aux_weight=aux_weight)


def backward(dlogits: np.ndarray, cache, cfg) -> dict:
    return ARCHITECTURES.get(cfg.arch).backward(dlogits, cache)


def loss_and_grads(params: dict, cfg, input_ids: np.ndarray, targets: np.ndarray, *, attention_mask=None,
                   label_smoothing: float = 0.0, aux_weight: float = 0.0, ignore_index: int = -100):
    """loss = CE(logits, targets) + aux_weight * aux, and d loss / d every parameter. Returns
    (loss, grads, logits); grads has exactly the keys of params."""
    logits, cache = forward(params, cfg, input_ids, attention_mask=attention_mask, aux_weight=aux_weight)
    ce, cce = cross_entropy_forward(logits, targets, label_smoothing=label_smoothing, ignore_index=ignore_index)
    grads = backward(cross_entropy_backward(1.0, cce), cache, cfg)
    for name, value in params.items():  # a parameter the batch never touched gets an exact zero
        grads.setdefault(name, np.zeros_like(value))
    return ce + aux_weight * aux_loss(cache), grads, logits
