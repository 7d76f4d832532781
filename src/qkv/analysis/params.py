"""Parameter counts per component, from a ModelConfig alone (note 000 LLM §1.2, §8.1; SPEC F1).

Per layer (D width, H heads, Hkv key/value heads, Dh = D / H, F FFN width, E experts):
    attention   D*H*Dh (W^Q) + 2*D*Hkv*Dh (W^K, W^V) + H*Dh*D (W^O)  [+ H*Dh + 2*Hkv*Dh + D biases]
                latent (qkv.nn.mla): D r_q + r_q + r_q H Dh (or D H Dh) + D (r + d_R) + r + r H (d_N + d_V) + H d_V D
                [+ 2*Dh QK-norm gains; (H + Hkv)*Dh over all heads (model.qk_norm_whole)] [+ H sinks]
                = 4 D^2 for MHA without biases (note 000 §2.2.2)
    FFN (mlp)   2*D*F [+ F + D]        (note 000 §4.1: W1 (D, F), W2 (F, D), b1, b2)
    FFN (glu)   3*D*F [+ 2F + D]       (note 003, SwiGLU: gate, up and down projections)
    MoE         E * FFN_e + D*E [+ FFN_s]   (E expert FFNs moe_d_ff wide + the router, no bias; note 002;
                                        the shared experts one FFN S * moe_d_ff wide: DeepSeek)
                a token uses k * FFN_e + D*E [+ FFN_s] of it ("active"); the plan's dense layers
                (model.moe_dense_layers: DeepSeek's first three) are dense FFNs, d_ff wide
    LayerNorm   D [+ D]  (gamma, beta; note 000 §5.1);  RMSNorm D (note 003); two per sublayer (pre / post),
                four with sandwich placement (a norm before and after each sublayer)
Model: token embedding V*D (a decoder's hashed bigram table adds N*D, model.bigram_vocab), a learned
position table max_seq_len*D, the layers, a final norm for Pre-LN stacks, and an output projection V*D
unless tied to the embedding (note 000 LLM §1.2); encoders add a head (BERT's MLM or classifier), encoder-decoders a second stack with cross-attention (note 000 §8).
Every count here equals `sum(p.numel() for p in build_model(cfg).parameters())` (tests/analysis).
"""
from __future__ import annotations

from dataclasses import replace
from typing import Callable

from qkv.config import ModelConfig
from qkv.registry import Registry
from qkv.models import build
from qkv.nn.residual import RESIDUALS
from qkv.plan import layer_plans

# ---- one formula per variant axis; a variant without a formula is counted by building that one module ----


def linear(n_in: int, n_out: int, bias: bool) -> int:
    return n_in * n_out + (n_out if bias else 0)


def attention(cfg: ModelConfig) -> int:
    if cfg.mla_kv_rank:
        return latent_attention(cfg)
    q_width, kv_width = cfg.n_heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
    return (linear(cfg.d_model, q_width, cfg.bias) + 2 * linear(cfg.d_model, kv_width, cfg.bias)
            + linear(q_width, cfg.d_model, cfg.bias) + qk_norm_gains(cfg)
            + (cfg.n_heads if cfg.attn_sinks else 0))  # a sink logit per head


def latent_attention(cfg: ModelConfig) -> int:
    """Multi-head latent attention (qkv.nn.mla): W_DQ, its norm and W_UQ (or W_Q), [W_DKV ; W_KR], the latent's
    norm, [W_UK ; W_UV] and W_O."""
    H, Dh, r, rq = cfg.n_heads, cfg.head_dim, cfg.mla_kv_rank, cfg.mla_q_rank
    v_dim = cfg.mla_v_dims or Dh
    q = linear(cfg.d_model, rq, cfg.bias) + rq + rq * H * Dh if rq else cfg.d_model * H * Dh
    kv = linear(cfg.d_model, r + cfg.mla_rope_dims, cfg.bias) + r + r * H * (Dh - cfg.mla_rope_dims + v_dim)
    return q + kv + linear(H * v_dim, cfg.d_model, cfg.bias)


def qk_norm_gains(cfg: ModelConfig) -> int:
    if not cfg.qk_norm:
        return 0
    return (cfg.n_heads + cfg.kv_heads) * cfg.head_dim if cfg.qk_norm_whole else 2 * cfg.head_dim


FFN_FORMULAS: dict[str, Callable[[ModelConfig], int]] = {
    "mlp": lambda c: linear(c.d_model, c.d_ff, c.bias) + linear(c.d_ff, c.d_model, c.bias),
    "glu": lambda c: 2 * linear(c.d_model, c.d_ff, c.bias) + linear(c.d_ff, c.d_model, c.bias),
    "glu_clamped": lambda c: 2 * linear(c.d_model, c.d_ff, c.bias) + linear(c.d_ff, c.d_model, c.bias),
}
NORM_FORMULAS: dict[str, Callable[[ModelConfig], int]] = {
    "layernorm": lambda c: c.d_model * (2 if c.bias else 1),
    "rmsnorm": lambda c: c.d_model,
}
POSITIONAL_FORMULAS: dict[str, Callable[[ModelConfig], int]] = {
    "none": lambda c: 0, "sinusoidal": lambda c: 0, "rope": lambda c: 0, "alibi": lambda c: 0,
    "learned": lambda c: c.max_seq_len * c.d_model,
}


def _built(module) -> int:
    return sum(p.numel() for p in module.parameters())


def dense_ffn(cfg: ModelConfig) -> int:
    if cfg.ffn in FFN_FORMULAS:
        return FFN_FORMULAS[cfg.ffn](cfg)
    return _built(build.ffn(replace(cfg, moe_experts=0)))  # a variant added later: count the one (dense) module


def expert(cfg: ModelConfig, width: int) -> int:
    """One FFN of cfg.ffn `width` wide (an expert, the shared experts)."""
    return dense_ffn(replace(cfg, d_ff=width))


def ffn(cfg: ModelConfig, moe: bool | None = None) -> int:
    """The FFN of one layer: dense, or E experts, the router (D, E) and the shared experts. `moe`: whether
    this layer routes (qkv.plan), default: whether the model has experts."""
    if not (cfg.moe_experts if moe is None else moe):
        return dense_ffn(cfg)
    width = cfg.moe_d_ff or cfg.d_ff
    shared = expert(cfg, cfg.moe_shared_experts * width) if cfg.moe_shared_experts else 0
    router = cfg.d_model * cfg.moe_experts + (cfg.moe_experts if cfg.moe_router_bias else 0)
    return cfg.moe_experts * expert(cfg, width) + router + shared


def active_ffn(cfg: ModelConfig, moe: bool | None = None) -> int:
    """FFN parameters one token uses: top_k experts, the router and the shared experts."""
    if not (cfg.moe_experts if moe is None else moe):
        return dense_ffn(cfg)
    return ffn(cfg, True) - (cfg.moe_experts - cfg.moe_top_k) * expert(cfg, cfg.moe_d_ff or cfg.d_ff)


def routed_experts(cfg: ModelConfig) -> int:
    """The routed experts' parameters over a decoder's layers: what expert parallel splits over its ranks."""
    if cfg.arch != "decoder" or not cfg.moe_experts:
        return 0
    return sum(routed_layers(cfg, cfg.decoder_layers, True)) * cfg.moe_experts * expert(cfg, cfg.moe_d_ff or cfg.d_ff)


def routed_layers(cfg: ModelConfig, layers: int, decoder: bool) -> list[bool]:
    """Whether each layer of a stack routes: a decoder's as its plan says (dense layers listed), every layer
    of an encoder stack where the model has experts."""
    if decoder:
        return [plan.moe for plan in layer_plans(cfg)]
    return [bool(cfg.moe_experts)] * layers


def norm(cfg: ModelConfig) -> int:
    if cfg.norm in NORM_FORMULAS:
        return NORM_FORMULAS[cfg.norm](cfg)
    return _built(build.norm(cfg))


def positional(cfg: ModelConfig) -> int:
    if cfg.positional in POSITIONAL_FORMULAS:
        return POSITIONAL_FORMULAS[cfg.positional](cfg)
    return _built(build.positional(cfg))


def sublayer_norms(cfg: ModelConfig) -> int:
    """The norms of one sublayer: one (pre, post) or an inner and an outer one (sandwich)."""
    return (2 if RESIDUALS.get(cfg.norm_placement).paired else 1) * norm(cfg)


def final_norm(cfg: ModelConfig) -> int:
    """Pre-LN and sandwich stacks end with a norm (GPT-2's ln_f); Post-LN blocks already end in one."""
    return norm(cfg) if RESIDUALS.get(cfg.norm_placement).final_norm else 0


def lm_head(cfg: ModelConfig) -> int:
    return 0 if cfg.tie_embeddings else cfg.vocab_size * cfg.d_model


# ---- one function per architecture family: {component: parameters} ----------------------------

COUNTS: Registry[Callable[[ModelConfig], dict[str, int]]] = Registry("architecture")


def _stack(cfg: ModelConfig, layers: int, prefix: str, cross: bool = False, decoder: bool = False) -> dict[str, int]:
    routed = routed_layers(cfg, layers, decoder)
    parts = {f"{prefix}attention": layers * attention(cfg), f"{prefix}ffn": sum(ffn(cfg, moe) for moe in routed),
             f"{prefix}norms": layers * 2 * sublayer_norms(cfg)}
    if cross:
        parts[f"{prefix}cross_attention"] = layers * (attention(cfg) - (cfg.n_heads if cfg.attn_sinks else 0))
        parts[f"{prefix}norms"] += layers * sublayer_norms(cfg)
    parts[f"{prefix}final_norm"] = final_norm(cfg)
    return parts


def _embeddings(cfg: ModelConfig, tables: int = 1) -> dict[str, int]:
    """Token table(s) W_E, token-type table, one positional module and the optional embedding norm."""
    parts = {"embedding": (tables * cfg.vocab_size + cfg.type_vocab_size + cfg.bigram_vocab) * cfg.d_model,
             "positional": positional(cfg)}
    return {**parts, "embed_norm": norm(cfg)} if cfg.embed_norm else parts


@COUNTS.register("decoder")
def decoder(cfg: ModelConfig) -> dict[str, int]:
    return {**_embeddings(cfg), **_stack(cfg, cfg.decoder_layers, "", decoder=True), "lm_head": lm_head(cfg)}


HEADS: dict[str, Callable[[ModelConfig], int]] = {  # encoder heads (qkv.models.heads, BERT)
    "none": lambda c: 0,
    # transform W_t (D, D), its norm, the vocabulary projection (W_E when tied) and its bias b_V
    "mlm": lambda c: linear(c.d_model, c.d_model, c.bias) + norm(c) + lm_head(c) + c.vocab_size,
    # pooler W_p (D, D) (tanh), then the class projection W_c (n_classes, D)
    "classifier": lambda c: linear(c.d_model, c.d_model, c.bias) + linear(c.d_model, c.n_classes, c.bias),
}


@COUNTS.register("encoder")
def encoder(cfg: ModelConfig) -> dict[str, int]:
    """BERT-style stack (note 000 §7) and its head (`model.head`)."""
    return {**_embeddings(cfg), **_stack(cfg, cfg.encoder_layers, ""), "head": HEADS[cfg.head](cfg)}


@COUNTS.register("encoder-decoder")
def encoder_decoder(cfg: ModelConfig) -> dict[str, int]:
    """Each stack embeds with its own positional module (and embedding norm); tied, one W_E serves the
    source, the target and the output projection (Vaswani et al. §3.4), untied they are three tables."""
    embeddings = _embeddings(cfg, tables=1 if cfg.tie_embeddings else 2)
    embeddings = {name: n * (1 if name == "embedding" else 2) for name, n in embeddings.items()}  # per stack
    return {**embeddings, **_stack(cfg, cfg.encoder_layers, "encoder."),
            **_stack(cfg, cfg.decoder_layers, "decoder.", cross=True), "lm_head": lm_head(cfg)}


def unused(cfg: ModelConfig) -> int:
    """Parameters of the experts a token is not routed to, over every stack."""
    stacks = {"decoder": [(cfg.decoder_layers, True)], "encoder": [(cfg.encoder_layers, False)],
              "encoder-decoder": [(cfg.encoder_layers, False), (cfg.decoder_layers, False)]}[cfg.arch]
    return sum(ffn(cfg, moe) - active_ffn(cfg, moe) for layers, decoder in stacks
               for moe in routed_layers(cfg, layers, decoder))


def breakdown(cfg: ModelConfig) -> dict[str, int]:
    """{component: parameters} plus `total`, `non_embedding` (Kaplan et al.'s N: without the token and
    position tables) and `active` (per token: top-k experts of an MoE)."""
    parts = {name: count for name, count in COUNTS.get(cfg.arch)(cfg).items()}
    total = sum(parts.values())
    return {**parts, "total": total, "non_embedding": total - parts["embedding"] - parts["positional"],
            "active": total - unused(cfg)}


def count(cfg: ModelConfig) -> int:
    return breakdown(cfg)["total"]


def stage_layers(n_layers: int, stages: int) -> list[range]:
    """Pipeline parallel's split (qkv.parallel.pipeline): contiguous blocks per stage, sizes differing by at
    most one (earlier stages get the extra ones)."""
    bounds = [round(s * n_layers / stages) for s in range(stages + 1)]
    return [range(bounds[s], bounds[s + 1]) for s in range(stages)]
