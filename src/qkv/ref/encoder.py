"""The encoder and encoder-decoder families, forward and backward, from the decoder-only model's pieces
(qkv.ref.model: embedding, stack of blocks, output projection), as qkv.models.encoder / heads /
encoder_decoder (docs/derivations/encoder.md):

    encoder:           H0 = Norm_emb(E[x] s + T[type] + P);  H = Stack(H0) bidirectional   (B, T, D)
      head "none"      the hidden states themselves
      head "mlm"       logits = LN(act(H W_t + b_t)) W_V^T + b_V     (W_V = W_E when tied)      (B, T, V)
      head "classifier" logits = tanh(pool(H) W_p + b_p) W_c + b_c                          (B, C)
    encoder-decoder:   M = Encoder(src);  Y = Stack(Y0, memory M) causal, with cross-attention;
                       logits = Y W_out (W_out = W_E, and the source embedding too, when tied)

Backward runs the same steps in reverse; the memory's gradient is the sum over the decoder layers of each
cross-attention's dMemory (000 §8.4), accumulated under MEMORY_GRAD, and flows into the encoder's backward;
a tied matrix has one entry in params, and its gradient is the sum of every use.
"""
from __future__ import annotations

import math
from typing import Callable, NamedTuple

import numpy as np

from qkv.ref.attention import MEMORY_GRAD, AttentionContext
from qkv.ref.functional import (Grads, activation_backward, activation_forward, linear_backward,
                                linear_forward, scope)
from qkv.ref.kernels import KERNELS
from qkv.ref.model import (ARCHITECTURES, RefArchitecture, check_supported, embed_backward, embed_forward, make_context,
                           output_name, owner, stack_backward, stack_forward)
from qkv.ref.norms import NORMS
from qkv.ref.positional import POSITIONALS
from qkv.registry import Registry



def embed_scale(cfg) -> float:
    return math.sqrt(cfg.d_model) if cfg.embed_scale else 1.0  # Vaswani et al. §3.4


class EncoderStackCache(NamedTuple):
    embedding: tuple  # qkv.ref.model.EmbedCache
    stack: tuple  # qkv.ref.model.StackCache


def encoder_stack_forward(params, cfg, input_ids, attention_mask=None, token_type_ids=None, aux_weight=0.0,
                          prefix: str = ""):
    """(B, T) ids -> (B, T, D) hidden states: bidirectional self-attention (mask = padding only). `params`
    are the stack's, named `prefix`* in the model."""
    ctx = make_context(cfg, input_ids, attention_mask, causal=False, params=params, prefix=prefix)
    x, cemb = embed_forward(params, ctx, input_ids, cfg, token_type_ids, scale=embed_scale(cfg))
    x, cstack = stack_forward(params, cfg, x, ctx, cfg.encoder_layers, aux_weight=aux_weight)
    return x, EncoderStackCache(cemb, cstack)


def encoder_stack_backward(dx, cache: EncoderStackCache, grads: Grads) -> None:
    cemb, cstack = cache
    embed_backward(stack_backward(dx, cstack, grads), cemb, grads)


# ---- heads: forward(params, cfg, hidden, attention_mask) -> (out, cache), backward(dout, cache, grads) -> dhidden
# (grads: the model's root view; a head's parameters are head.*)

class Head(NamedTuple):
    forward: Callable
    backward: Callable


HEADS: Registry[Head] = Registry("encoder head")
HEADS.register("none")(Head(lambda params, cfg, hidden, mask: (hidden, None), lambda dout, cache, grads: dout))


class MLMCache(NamedTuple):
    transform: tuple  # linear_forward's cache of H W_t + b_t
    activation: tuple
    norm: tuple
    decoder: tuple  # of the vocabulary projection
    weight: str  # the projection's parameter name: head.decoder.weight, or encoder.tok_emb.weight when tied
    norm_name: str  # model.norm


def mlm_forward(params, cfg, hidden, attention_mask):
    head = scope(params, "head")
    h, ct = linear_forward(hidden, **scope(head, "transform"))  # H W_t + b_t   (B, T, D)
    a, ca = activation_forward(h, cfg.activation)
    n, cn = NORMS.get(cfg.norm).forward(scope(head, "norm"), a, cfg.norm_eps)
    weight = output_name(params, "head.decoder.weight", "encoder.tok_emb.weight")  # tied: W_V = W_E
    logits, cd = linear_forward(n, params[weight], head["decoder.bias"])  # (B, T, V)
    return logits, MLMCache(ct, ca, cn, cd, weight, cfg.norm)


def mlm_backward(dlogits, cache: MLMCache, grads: Grads):
    ct, ca, cn, cd, weight, norm_name = cache
    decoder = Grads()  # W_V may be W_E (tied): its gradient and b_V's land under different scopes
    dn = linear_backward(dlogits, cd, decoder)
    grads.add(weight, decoder.store["weight"])
    grads.add("head.decoder.bias", decoder.store["bias"])
    da = NORMS.get(norm_name).backward(dn, cn, grads.scope("head.norm"))
    return linear_backward(activation_backward(da, ca), ct, grads.scope("head.transform"))


HEADS.register("mlm")(Head(mlm_forward, mlm_backward))


def pool_forward(hidden, attention_mask, pooling: str):
    """first: h_0; mean: (1 / n_b) sum_t m_bt h_bt (qkv.models.heads.POOLINGS). (B, T, D) -> (B, D), and
    the weights w (B, T) with pooled = sum_t w_bt h_bt, which is also the backward: dh_bt = w_bt dpooled_b."""
    B, T, _ = hidden.shape
    if pooling == "first":
        weights = np.zeros((B, T))
        weights[:, 0] = 1.0
    elif attention_mask is None:
        weights = np.full((B, T), 1.0 / T)
    else:
        m = attention_mask.astype(hidden.dtype)
        weights = m / np.maximum(m.sum(axis=1, keepdims=True), 1)
    return np.einsum("bt,btd->bd", weights, hidden), weights


class ClassifierCache(NamedTuple):
    weights: np.ndarray  # the pooling weights w (B, T): pooled = sum_t w_t h_t
    pooler: tuple  # linear_forward's cache of pool(H) W_p + b_p
    pooled: np.ndarray  # tanh of it (B, D)
    out_proj: tuple


def classifier_forward(params, cfg, hidden, attention_mask):
    head = scope(params, "head")
    pooled, weights = pool_forward(hidden, attention_mask, cfg.pooling)
    z, cp = linear_forward(pooled, **scope(head, "pooler"))
    pooled = np.tanh(z)  # BERT's pooler   (B, D)
    logits, co = linear_forward(pooled, **scope(head, "out_proj"))  # (B, C)
    return logits, ClassifierCache(weights, cp, pooled, co)


def classifier_backward(dlogits, cache, grads: Grads):
    weights, cp, pooled, co = cache
    dpooled = linear_backward(dlogits, co, grads.scope("head.out_proj"))
    dz = dpooled * (1.0 - pooled ** 2)  # tanh' = 1 - tanh^2
    dpool = linear_backward(dz, cp, grads.scope("head.pooler"))
    return weights[:, :, None] * dpool[:, None, :]


HEADS.register("classifier")(Head(classifier_forward, classifier_backward))


# ---- the families -----------------------------------------------------------------------------

def encoder_forward(params: dict, cfg, input_ids, token_type_ids=None, attention_mask=None, aux_weight: float = 0.0):
    """(B, T) ids -> hidden (B, T, D), MLM logits (B, T, V) or class logits (B, C), by model.head."""
    check_supported(cfg)
    prefix = "" if cfg.head == "none" else "encoder"  # a head wraps the bare encoder as `encoder`
    stack_params = scope(params, prefix) if prefix else params
    hidden, cenc = encoder_stack_forward(stack_params, cfg, input_ids, attention_mask, token_type_ids, aux_weight,
                                         prefix=f"{prefix}." if prefix else "")
    head = HEADS.get(cfg.head)
    out, chead = head.forward(params, cfg, hidden, attention_mask)
    return out, {"blocks": cenc[1].blocks, "tape": (prefix, cenc, head, chead)}


def encoder_backward(dout, cache) -> dict:
    prefix, cenc, head, chead = cache["tape"]
    grads = Grads()
    dhidden = head.backward(dout, chead, grads)  # a tied MLM decoder writes encoder.tok_emb.weight
    encoder_stack_backward(dhidden, cenc, grads.scope(prefix) if prefix else grads)
    return grads.store


ARCHITECTURES.register("encoder")(RefArchitecture(encoder_forward, encoder_backward))


def cross_context(cfg, positions, src_mask, memory_len: int) -> AttentionContext:
    """Queries at the target positions over all source columns minus padding; no positional hook and no
    own-column rescue (qkv.models.context.cross_context). A sparse or linear cfg.attention applies to
    self-attention only: cross-attention is full softmax attention (qkv.models.build.attention)."""
    kernel = KERNELS.get(cfg.attention)(cfg)
    kernel = kernel if kernel.full else KERNELS.get("sdpa")(cfg)
    B, T = positions.shape
    mask = None if src_mask is None else np.broadcast_to(src_mask.astype(bool)[:, None, None, :],
                                                         (B, 1, T, memory_len))
    return AttentionContext(POSITIONALS.get("none")(cfg), positions, np.broadcast_to(np.arange(memory_len),
                            (B, memory_len)), mask, causal=False, kernel=kernel,
                            n_heads=cfg.n_heads, norm_eps=cfg.norm_eps)


def encoder_decoder_forward(params: dict, cfg, src_ids, tgt_ids, attention_mask=None, aux_weight: float = 0.0):
    """(B, S) source and (B, T) target ids -> (B, T, V) teacher-forced logits; attention_mask is None or the
    pair (src_mask, tgt_mask), each None or (B, len) with 1 = token."""
    check_supported(cfg)
    src_mask, tgt_mask = attention_mask if attention_mask is not None else (None, None)
    encoder_params = scope(params, "encoder")
    encoder_params.setdefault("tok_emb.weight", params["tok_emb.weight"])  # tied: one W_E for both sides
    memory, cenc = encoder_stack_forward(encoder_params, cfg, src_ids, src_mask, aux_weight=aux_weight,
                                         prefix="encoder.")  # (B, S, D)
    ctx = make_context(cfg, tgt_ids, tgt_mask, causal=True, params=params,
                       positional=POSITIONALS.get(cfg.positional).decoder_twin)
    x, cemb = embed_forward(params, ctx, tgt_ids, cfg, scale=embed_scale(cfg))  # Y0   (B, T, D)
    x, cstack = stack_forward(params, cfg, x, ctx, cfg.decoder_layers, memory=memory,
                              memory_ctx=cross_context(cfg, ctx.positions, src_mask, memory.shape[1]),
                              aux_weight=aux_weight)
    out_name = output_name(params, "lm_head.weight", "tok_emb.weight")
    logits, chead = linear_forward(x, params[out_name])  # (B, T, V)
    tied_source = "encoder.tok_emb.weight" not in params
    return logits, {"blocks": cenc[1].blocks + cstack.blocks, "tape": (cenc, cemb, cstack, chead, out_name, tied_source)}


def encoder_decoder_backward(dlogits, cache) -> dict:
    cenc, cemb, cstack, chead, out_name, tied_source = cache["tape"]
    grads = Grads()
    dx = linear_backward(dlogits, chead, grads.scope(owner(out_name)))
    embed_backward(stack_backward(dx, cstack, grads), cemb, grads)
    dmemory = grads.store.pop(MEMORY_GRAD)  # summed over the decoder layers' cross-attention
    encoder_stack_backward(dmemory, cenc, grads.scope("encoder"))
    if tied_source:  # the source embedding is W_E as well: its scatter-add joins tok_emb.weight
        grads.add("tok_emb.weight", grads.store.pop("encoder.tok_emb.weight"))
    return grads.store


ARCHITECTURES.register("encoder-decoder")(RefArchitecture(encoder_decoder_forward, encoder_decoder_backward))
