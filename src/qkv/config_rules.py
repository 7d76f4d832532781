"""The model section's rules that combine its fields (ModelConfig.validate calls them): the experts' routing,
latent attention's sizes, the per-layer plan's sizes, and the fields only some architectures use. A leaf beside
qkv.config: it imports nothing of qkv but the error type and the value rules."""
from __future__ import annotations

from qkv.config_values import _at_least, _positive
from qkv.errors import QkvError


def experts(cfg) -> None:
    """The routing fields against the expert count (their meaning: qkv.nn.moe)."""
    for name in ("moe_groups", "moe_group_top_k", "moe_d_ff", "moe_shared_experts"):
        _at_least(f"model.{name}", getattr(cfg, name), 0)
    _positive("model.moe_scale", cfg.moe_scale)
    if cfg.moe_scoring not in ("softmax", "sigmoid"):
        raise QkvError(f"model.moe_scoring={cfg.moe_scoring!r}; choose from: softmax, sigmoid")
    if cfg.moe_groups > 1:
        if cfg.moe_experts % cfg.moe_groups:
            raise QkvError(f"model.moe_groups={cfg.moe_groups} must divide model.moe_experts={cfg.moe_experts}")
        if not 1 <= cfg.moe_group_top_k <= cfg.moe_groups:
            raise QkvError(f"model.moe_group_top_k={cfg.moe_group_top_k} must be in 1..model.moe_groups="
                           f"{cfg.moe_groups}")
        if cfg.moe_top_k > cfg.moe_group_top_k * (cfg.moe_experts // cfg.moe_groups):
            raise QkvError(f"model.moe_top_k={cfg.moe_top_k} is more than the "
                           f"{cfg.moe_group_top_k * (cfg.moe_experts // cfg.moe_groups)} experts of "
                           f"model.moe_group_top_k={cfg.moe_group_top_k} groups")
    bad = [i for i in cfg.moe_dense_layers if not 0 <= i < cfg.decoder_layers]
    if bad:
        raise QkvError(f"model.moe_dense_layers has {bad[0]}, not a layer of 0..{cfg.decoder_layers - 1}")
    if not cfg.moe_experts:
        changed = [name for name, default in (("moe_scoring", "softmax"), ("moe_norm_topk", True),
                                              ("moe_scale", 1.0), ("moe_groups", 0), ("moe_group_top_k", 0),
                                              ("moe_choice_bias", False), ("moe_d_ff", 0),
                                              ("moe_shared_experts", 0), ("moe_dense_layers", ()))
                   if getattr(cfg, name) != default]
        if changed:
            raise QkvError(f"model.{changed[0]}={getattr(cfg, changed[0])!r} needs experts: set model.moe_experts")

def latent(cfg) -> None:
    """Multi-head latent attention's sizes (qkv.nn.mla)."""
    for name in ("mla_kv_rank", "mla_q_rank", "mla_rope_dims", "mla_v_dims"):
        _at_least(f"model.{name}", getattr(cfg, name), 0)
    if not cfg.mla_kv_rank:
        used = [n for n in ("mla_q_rank", "mla_rope_dims", "mla_v_dims") if getattr(cfg, n)]
        if used:
            raise QkvError(f"model.{used[0]}={getattr(cfg, used[0])} belongs to latent attention: set model.mla_kv_rank")
        return
    if cfg.mla_rope_dims % 2 or not 2 <= cfg.mla_rope_dims < cfg.head_dim:
        raise QkvError(f"model.mla_rope_dims={cfg.mla_rope_dims} must be even and in 2..head_dim - 1 "
                       f"(head_dim={cfg.head_dim}: the rope dims and the latent's nope dims)")
    if cfg.arch != "decoder" or cfg.positional != "rope" or cfg.layer_types or cfg.n_kv_heads not in (
            0, cfg.n_heads) or cfg.qk_norm or cfg.attn_softcap or cfg.rope_dims or cfg.attn_sinks:
        raise QkvError("model.mla_kv_rank: latent attention is built for a decoder with positional='rope', every "
                       "layer global, no q/k norm, soft cap, sinks, partial rotation or grouped K/V heads (its heads "
                       "share the latent)")

def layers(cfg) -> None:
    """The per-layer plan's sizes (its names are qkv.plan's to check)."""
    if cfg.layer_types and len(cfg.layer_types) != cfg.decoder_layers:
        raise QkvError(f"model.layer_types has {len(cfg.layer_types)} entries for "
                       f"{cfg.decoder_layers} layers: one per layer")
    if cfg.layer_types and cfg.arch != "decoder":
        raise QkvError(f"model.layer_types needs model.arch='decoder', got model.arch={cfg.arch!r}")
    if "sliding" in cfg.layer_types and cfg.sliding_window < 1:
        raise QkvError(f"model.layer_types has sliding layers: model.sliding_window must be >= 1, "
                       f"got {cfg.sliding_window}")

def family(cfg) -> None:
    """The fields that only some architectures use (encoder heads, token types, embedding options)."""
    _at_least("model.type_vocab_size", cfg.type_vocab_size, 0)
    _at_least("model.n_classes", cfg.n_classes, 0)
    if cfg.arch != "encoder":
        for name, default in (("head", "none"), ("type_vocab_size", 0)):
            if getattr(cfg, name) != default:
                raise QkvError(f"model.{name}={getattr(cfg, name)!r} needs model.arch='encoder', "
                               f"got model.arch={cfg.arch!r}")
    if cfg.arch != "decoder" and cfg.logit_softcap:
        raise QkvError(f"model.logit_softcap={cfg.logit_softcap} needs model.arch='decoder', "
                       f"got model.arch={cfg.arch!r}")
    if cfg.arch != "decoder" and cfg.bigram_vocab:
        raise QkvError(f"model.bigram_vocab={cfg.bigram_vocab} needs model.arch='decoder', "
                       f"got model.arch={cfg.arch!r}")
    if cfg.arch == "decoder" and cfg.embed_norm:
        raise QkvError("model.embed_norm=True needs model.arch='encoder' or 'encoder-decoder'")
    if cfg.head == "classifier" and cfg.n_classes < 2:
        raise QkvError(f"model.n_classes={cfg.n_classes} must be at least 2 with model.head='classifier'")
    if cfg.labels and len(cfg.labels) != cfg.n_classes:
        raise QkvError(f"model.labels has {len(cfg.labels)} names, model.n_classes={cfg.n_classes}")
