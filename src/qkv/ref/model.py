"""Whole models: forward lists the layers, backward calls their twins in exactly the reverse order and
accumulates every parameter gradient with += (llm.c's train_gpt2.c; STYLE.md 3).

    H0 = E[x] s + P               embedding (000 LLM §2.1), backward a scatter-add (§3.5); s = sqrt(D) (Gemma) or 1
                                  [+ E_2[h(x_{t-1}, x_t)]: model.bigram_vocab's hashed pair table, the same]
    H^l = Block^l(H^{l-1})         l = 1..L (§2.2), backward §3.3-§3.4; each layer as qkv.plan says
    logits = LN(H^L) W_out         (§2.3; W_out = W_E when tied), backward §3.2
    loss = CE(logits, y)           (§2.4), backward (P - onehot) / N (§3.1)

`ARCHITECTURES.get(cfg.arch)` gives a `RefArchitecture(forward, backward)`: "decoder" here, "encoder" (bare, MLM,
classifier heads) and "encoder-decoder" in qkv.ref.encoder, built from the same pieces (embedding, stack,
output projection). A family's cache is a dict whose "blocks" lists every block cache (for the MoE loss).
"""
from __future__ import annotations

import math
from dataclasses import replace
from typing import Any, Callable, NamedTuple

import numpy as np

from qkv.errors import QkvError
from qkv.plan import layer_plans
from qkv.ref.attention import AttentionContext
from qkv.ref.block import RESIDUALS, aux_losses, block_backward, block_forward
from qkv.ref.functional import (Grads, cross_entropy_backward, cross_entropy_forward, embedding_backward,
                                embedding_forward, linear_backward, linear_forward, scope, soft_cap_backward,
                                soft_cap_forward)
from qkv.ref.kernels import KERNELS, causal_mask
from qkv.ref.norms import NORMS
from qkv.ref.positional import POSITIONALS
from qkv.registry import Registry


class RefArchitecture(NamedTuple):
    forward: Callable  # (params, cfg, input_ids, attention_mask=None, aux_weight=0.0) -> (logits, cache)
    backward: Callable  # (dlogits, cache) -> grads, keyed by the torch parameter names


ARCHITECTURES: Registry[RefArchitecture] = Registry("architecture")


def check_supported(cfg) -> None:
    if cfg.dropout:
        raise QkvError(f"model.dropout={cfg.dropout}: the reference engine is deterministic; set model.dropout=0")


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


def make_context(cfg, input_ids, attention_mask, causal: bool, params: dict | None = None,
                 positional: str | None = None, prefix: str = "") -> AttentionContext:
    """`params` are the stack's parameters (its `positional.*` are the encoding's), named `prefix`* in the
    model ("encoder." for an encoder under a head or in an encoder-decoder); `positional` overrides
    cfg.positional (the encoder-decoder's decoder takes T5's causal twin, as qkv.models.build)."""
    positions, mask = positions_and_mask(input_ids, attention_mask, causal)
    turned = replace(cfg, head_size=cfg.mla_rope_dims) if getattr(cfg, "mla_kv_rank", 0) else cfg  # (latent
    # attention turns its shared RoPE dims alone: qkv.nn.mla)
    return AttentionContext(POSITIONALS.get(positional or cfg.positional)(turned), positions, positions, mask,
                            causal=causal and mask is None, kernel=KERNELS.get(cfg.attention)(cfg),
                            n_heads=cfg.n_heads, params=scope(params or {}, "positional"),
                            positional_prefix=f"{prefix}positional.", norm_eps=cfg.norm_eps)


class EmbedCache(NamedTuple):
    """What embed_forward keeps for embed_backward."""

    tokens: tuple  # embedding_forward's cache of E[x]
    types: tuple | None  # of T[type], or None without token types
    bigrams: tuple | None  # of E_2[h(x_{t-1}, x_t)], or None without the bigram table
    positions: Any  # the positional encoding's embed_forward cache
    norm: Any  # the embedding norm's cache, or None
    scale: float  # s
    positional: Any  # the encoding (its embed_backward)
    norm_name: str  # model.norm (the embedding norm's backward)


class StackCache(NamedTuple):
    """What stack_forward keeps for stack_backward."""

    blocks: list  # each block's cache, in forward order
    final_norm: Any  # the final norm's cache, or None (Post-LN)
    ctx: AttentionContext  # holds the positional encoding's accumulated gradients
    norm_name: str


def bigram_rows(input_ids: np.ndarray, attention_mask: np.ndarray | None, rows: int) -> np.ndarray:
    """(B, T) rows of the bigram table: h(p, c) = (36313 c XOR 27191 p) mod (N - 1) for a token c after p,
    N - 1 for a token with no previous one (the first of a row, or after padding; qkv.nn.embedding)."""
    current = input_ids.astype(np.int64)
    previous = np.concatenate([np.zeros_like(current[:, :1]), current[:, :-1]], axis=1)
    has_previous = np.ones(current.shape, dtype=bool)
    has_previous[:, 0] = False
    if attention_mask is not None:
        has_previous[:, 1:] &= attention_mask[:, :-1].astype(bool)
    hashed = np.bitwise_xor(36313 * current, 27191 * previous) % (rows - 1)
    return np.where(has_previous, hashed, rows - 1)


def embed_forward(params, ctx: AttentionContext, input_ids, cfg=None, token_type_ids=None, scale: float = 1.0,
                  attention_mask=None):
    """H0 = Norm_emb(E[x] * s + T[type] + P): the type table and the norm only where params hold them
    (encoder families; qkv.models.encoder.Encoder.embed); a decoder's bigram table E_2 where they hold it."""
    x, ce = embedding_forward(input_ids, params["tok_emb.weight"])  # E = onehot(X) W_E   (B, T, D)
    x = x * scale  # s = sqrt(D) with model.embed_scale (Vaswani et al. §3.4), else 1
    ct = cn = cb = None
    if "bigram_emb.weight" in params:
        table = params["bigram_emb.weight"]
        b, cb = embedding_forward(bigram_rows(input_ids, attention_mask, table.shape[0]), table)
        x = x + b  # E[x_t] + E_2[h(x_{t-1}, x_t)]
    if "type_emb.weight" in params:
        types = np.zeros_like(input_ids) if token_type_ids is None else token_type_ids
        t, ct = embedding_forward(types, params["type_emb.weight"])  # T[type]   (B, T, D)
        x = x + t
    x, cp = ctx.positional.embed_forward(ctx.params, x, ctx.positions)  # H0 = E + P
    if "embed_norm.weight" in params:
        x, cn = NORMS.get(cfg.norm).forward(scope(params, "embed_norm"), x, cfg.norm_eps)
    return x, EmbedCache(ce, ct, cb, cp, cn, scale, ctx.positional, cfg.norm if cfg is not None else "")


def embed_backward(dx, cache: EmbedCache, grads: Grads) -> None:
    if cache.norm is not None:
        dx = NORMS.get(cache.norm_name).backward(dx, cache.norm, grads.scope("embed_norm"))
    # dP = dH0 (000 LLM §3.5), learned tables only
    dx = cache.positional.embed_backward(dx, cache.positions, grads.scope("positional"))
    if cache.types is not None:
        embedding_backward(dx, cache.types, grads.scope("type_emb"))  # scatter-add onto the type rows
    if cache.bigrams is not None:
        embedding_backward(dx, cache.bigrams, grads.scope("bigram_emb"))  # onto the hashed pairs' rows
    embedding_backward(dx * cache.scale, cache.tokens, grads.scope("tok_emb"))  # dW_E = onehot^T (s dH0) (§3.5)


def layer_contexts(cfg, ctx: AttentionContext, layers: int) -> list[AttentionContext]:
    """Each layer's context as the plan says (qkv.plan, the torch engine's own plan): a sliding layer's mask cut
    to its last W key positions, a layer's own rotation (a local base, or none: NoPE), and the model-wide score
    scale and soft cap."""
    if cfg.arch != "decoder":
        return [ctx] * layers
    common = replace(ctx, scale=cfg.query_scale ** -0.5 if cfg.query_scale else 0.0, softcap=cfg.attn_softcap)
    out = []
    for plan in layer_plans(cfg):
        layer = common
        if plan.window:
            T, S = ctx.positions.shape[1], ctx.key_positions.shape[1]
            base = ctx.mask if ctx.mask is not None else (causal_mask(T, S) if ctx.causal else True)
            near = ctx.key_positions[:, None, None, :] > ctx.positions[:, None, :, None] - plan.window  # (B, 1, T, S)
            layer = replace(layer, mask=base & near, causal=False)
        if plan.kind == "nope":
            layer = replace(layer, positional=POSITIONALS.get("none")(cfg))
        elif plan.rope_theta is not None:  # its own base, unscaled (Gemma 3's sliding layers)
            layer = replace(layer, positional=POSITIONALS.get("rope")(
                replace(cfg, rope_theta=plan.rope_theta, rope_scaling="none")))
        out.append(layer)
    return out


def stack_forward(params, cfg, x, ctx, layers: int, memory=None, memory_ctx=None, aux_weight: float = 0.0):
    """H^l = Block^l(H^{l-1}), l = 1..L, each layer with its plan's context (layer_contexts), then the final
    norm where the placement leaves the stream unnormalised (pre, sandwich: the placement's `final_norm`)."""
    cblocks = []
    for i, layer_ctx in enumerate(layer_contexts(cfg, ctx, layers)):
        x, cb = block_forward(scope(params, f"blocks.{i}"), x, cfg, layer_ctx, memory=memory, memory_ctx=memory_ctx,
                              aux_weight=aux_weight)
        cblocks.append(cb)
    cn = None
    if RESIDUALS.get(cfg.norm_placement).final_norm:
        x, cn = NORMS.get(cfg.norm).forward(scope(params, "final_norm"), x, cfg.norm_eps)
    return x, StackCache(cblocks, cn, ctx, cfg.norm)


def stack_backward(dx, cache: StackCache, grads: Grads) -> np.ndarray:
    """Returns dH0. The layers add their shares of the shared relative tables under the stack's
    positional.* (and a decoder's cross-attention its memory gradient) as they go."""
    if cache.final_norm is not None:
        dx = NORMS.get(cache.norm_name).backward(dx, cache.final_norm, grads.scope("final_norm"))
    for i in reversed(range(len(cache.blocks))):  # 000 LLM §3.4: layer by layer, l = L..1
        dx = block_backward(dx, cache.blocks[i], grads.scope(f"blocks.{i}"))
    return dx


def output_name(params, name: str, tied_to: str) -> str:
    """A tied projection has no entry of its own (named_parameters dedupes it): it is the matrix it shares."""
    return name if name in params else tied_to


def owner(name: str) -> str:
    """The layer scope of a parameter name: "tok_emb.weight" -> "tok_emb"."""
    return name.rpartition(".")[0]


def decoder_forward(params: dict, cfg, input_ids: np.ndarray, attention_mask=None, aux_weight: float = 0.0):
    """(B, T) token ids -> (B, T, V) logits, as qkv.models.decoder.DecoderLM.forward."""
    check_supported(cfg)
    ctx = make_context(cfg, input_ids, attention_mask, causal=True, params=params)
    scale = math.sqrt(cfg.d_model) if cfg.embed_scale else 1.0  # Gemma's embeddings times sqrt(D)
    x, cemb = embed_forward(params, ctx, input_ids, attention_mask=attention_mask, scale=scale)
    x, cstack = stack_forward(params, cfg, x, ctx, cfg.decoder_layers, aux_weight=aux_weight)
    out_name = output_name(params, "lm_head.weight", "tok_emb.weight")  # tied: W_out is W_E itself
    logits, chead = linear_forward(x, params[out_name])  # L = H^L W_o   (B, T, V)
    logits, ccap = soft_cap_forward(logits, cfg.logit_softcap)
    return logits, {"blocks": cstack.blocks, "tape": (cemb, cstack, chead, out_name, ccap)}


def decoder_backward(dlogits: np.ndarray, cache) -> dict:
    cemb, cstack, chead, out_name, ccap = cache["tape"]
    grads = Grads()
    dlogits = soft_cap_backward(dlogits, ccap)
    # dW_o = (H^L)^T dL, dH^L = dL W_o^T (000 LLM §3.2); tied: it lands on tok_emb.weight, the embedding adds the rest
    dx = linear_backward(dlogits, chead, grads.scope(owner(out_name)))
    dx = stack_backward(dx, cstack, grads)
    embed_backward(dx, cemb, grads)
    return grads.store


ARCHITECTURES.register("decoder")(RefArchitecture(decoder_forward, decoder_backward))


def aux_loss(cache) -> float:
    """Sum of the blocks' MoE load-balancing losses (unweighted), over every stack of the model."""
    return sum(aux_losses(cb) for cb in cache["blocks"])


def forward(params: dict, cfg, *inputs, attention_mask=None, aux_weight: float = 0.0):
    return ARCHITECTURES.get(cfg.arch).forward(params, cfg, *inputs, attention_mask=attention_mask,
                                               aux_weight=aux_weight)


def backward(dlogits: np.ndarray, cache, cfg) -> dict:
    return ARCHITECTURES.get(cfg.arch).backward(dlogits, cache)


def loss_and_grads(params: dict, cfg, input_ids, targets: np.ndarray, *, attention_mask=None,
                   label_smoothing: float = 0.0, aux_weight: float = 0.0, ignore_index: int = -100):
    """loss = CE(logits, targets) + aux_weight * aux, and d loss / d every parameter. Returns
    (loss, grads, logits); grads has exactly the keys of params. `input_ids` is the family's input, or a
    tuple of them: (ids,) or (ids, token_type_ids) for an encoder, (src_ids, tgt_ids) for an
    encoder-decoder (whose attention_mask is then None or the pair (src_mask, tgt_mask))."""
    inputs = input_ids if isinstance(input_ids, tuple) else (input_ids,)
    logits, cache = forward(params, cfg, *inputs, attention_mask=attention_mask, aux_weight=aux_weight)
    ce, cce = cross_entropy_forward(logits, targets, label_smoothing=label_smoothing, ignore_index=ignore_index)
    grads = backward(cross_entropy_backward(1.0, cce), cache, cfg)
    for name, value in params.items():  # a parameter the batch never touched gets an exact zero
        grads.setdefault(name, np.zeros_like(value))
    return ce + aux_weight * aux_loss(cache), grads, logits

