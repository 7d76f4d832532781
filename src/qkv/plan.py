"""The per-layer plan: what each layer of a decoder is, read from its ModelConfig in this one place.

Models of 2024-25 do not repeat one layer: Gemma 2 alternates a sliding window of 4,096 keys with global
attention, Gemma 3 puts five 512-key sliding layers before each global one and turns its sliding layers' RoPE
on a base of 10,000 against the global layers' 1,000,000, SmolLM3 leaves RoPE out of every fourth layer
(NoPE), Mistral slides every layer. `model.layer_types` names each layer's kind:

    global   attention over every key before it, rotated by the model's encoding (its scaling included)
    sliding  attention over the last model.sliding_window keys (itself included: key j of query i where
             i - W < j <= i, as transformers and llama.cpp mask it), rotated at model.rope_local_theta where set
             (unscaled, Gemma 3), else as a global layer
    nope     attention over every key before it, with no rotation (SmolLM3's no_rope_layers)

and its FFN: in a mixture-of-experts model (model.moe_experts > 0) every layer routes its tokens to experts
but those model.moe_dense_layers lists, whose FFN is dense and model.d_ff wide (DeepSeek's first layers,
Qwen3-MoE's mlp_only_layers).

`layer_plans(cfg)` gives one `LayerPlan` per layer; the builder (qkv.models.build), the KV cache
(qkv.nn.cache: a sliding layer's ring), the compiled decoding step, the calculators (qkv.analysis), the reference
engine (qkv.ref.model) and the checks read it, and nothing else asks "which layer is this". It is plain Python
beside the config (layer 0), so that the NumPy engine reads the same plan as the torch one. The model-wide facts sit beside it in the config:
head_size (Dh not D / H), query_scale, attn_softcap, logit_softcap, qk_norm, embed_scale, norm_placement
(Gemma's four norms a block are the sandwich placement).

Adding an architecture: docs/ARCHITECTURE.md, "How to add an architecture".
"""
from __future__ import annotations

from dataclasses import dataclass

from qkv.config import ModelConfig
from qkv.errors import QkvError
from qkv.rope_scaling import RopeScaling

LAYER_KINDS = ("global", "sliding", "nope")  # model.layer_types' entries
RING_SPARE = 16  # a sliding layer's ring keeps W + RING_SPARE columns (qkv.nn.cache)


@dataclass(frozen=True)
class LayerPlan:
    """One decoder layer: its kind, the keys it sees and how it is rotated."""

    kind: str  # LAYER_KINDS
    window: int  # keys it sees, itself included; 0: every key before it
    rope_theta: float | None  # its own RoPE base, unscaled (Gemma 3's local one), or None: the model's encoding
    # (none at all for a nope layer)
    moe: bool = False  # its FFN is a mixture of experts (qkv.nn.moe), else dense

    @property
    def own_positions(self) -> bool:
        """Rotated otherwise than by the model's encoding (its own base, or not at all)."""
        return self.kind == "nope" or self.rope_theta is not None


def rope_scaling(cfg: ModelConfig) -> RopeScaling:
    """model.rope_* as one RopeScaling, checked."""
    return RopeScaling(kind=cfg.rope_scaling, factor=cfg.rope_factor, original_context=cfg.rope_original_context,
                       low_freq_factor=cfg.rope_low_freq_factor, high_freq_factor=cfg.rope_high_freq_factor,
                       beta_fast=cfg.rope_beta_fast, beta_slow=cfg.rope_beta_slow, long_factors=cfg.rope_long_factors,
                       short_factors=cfg.rope_short_factors, attention_factor=cfg.rope_attention_factor,
                       yarn_mscale=cfg.rope_yarn_mscale, yarn_truncate=cfg.rope_yarn_truncate).check()


def layer_kinds(cfg: ModelConfig) -> tuple[str, ...]:
    """Each layer's kind: model.layer_types, or every layer global."""
    kinds = cfg.layer_types or ("global",) * cfg.decoder_layers
    for i, kind in enumerate(kinds):
        if kind not in LAYER_KINDS:
            raise QkvError(f"model.layer_types[{i}]={kind!r} is not a layer kind; choose from: {', '.join(LAYER_KINDS)}")
    return kinds


def layer_plans(cfg: ModelConfig) -> tuple[LayerPlan, ...]:
    """One LayerPlan per decoder layer (module docstring)."""
    rope = cfg.positional == "rope"
    if cfg.layer_types and not rope:
        raise QkvError(f"model.layer_types needs model.positional='rope' (its kinds differ in their rotation), "
                       f"got {cfg.positional!r}")
    plans = []
    for i, kind in enumerate(layer_kinds(cfg)):
        moe = bool(cfg.moe_experts) and i not in cfg.moe_dense_layers
        if kind == "sliding":
            local = cfg.rope_local_theta or None
            plans.append(LayerPlan(kind, cfg.sliding_window, local, moe))
        else:
            plans.append(LayerPlan(kind, 0, None, moe))
    return tuple(plans)


def check_plan(cfg: ModelConfig) -> None:
    """The plan's facts against the rest of the config (check_model calls it). Reads model.layer_types itself,
    never a plan of model.n_layers entries (a config may claim any number of layers before it is refused)."""
    rope_scaling(cfg)
    if cfg.layer_types:
        layer_plans(cfg)  # (its kinds' names; one entry per layer is config.validate's)
    if cfg.rope_scaling != "none" and cfg.positional != "rope":
        raise QkvError(f"model.rope_scaling={cfg.rope_scaling!r} needs model.positional='rope', got {cfg.positional!r}")
    if cfg.sliding_window and "sliding" not in cfg.layer_types:
        raise QkvError(f"model.sliding_window={cfg.sliding_window} but no layer is sliding: set model.layer_types")
    if cfg.rope_local_theta and "sliding" not in cfg.layer_types:
        raise QkvError(f"model.rope_local_theta={cfg.rope_local_theta} but no layer is sliding: set model.layer_types")


def cached_columns(plan: LayerPlan, length: int) -> int:
    """Key columns a layer's cache holds for `length` tokens: a sliding layer's ring, W + RING_SPARE slots at any
    length (qkv.nn.cache.KVCache keeps it so)."""
    return plan.window + RING_SPARE if plan.window else length
