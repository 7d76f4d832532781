"""Gemma 2 and Gemma 3 (text) (transformers' modeling_gemma2.py, modeling_gemma3.py) <-> qkv's decoder LM.

What sets them apart from LLaMA, each a field of qkv's config or plan (qkv.plan):
- four norms a block: x + post(attn(pre(x))), then the same around the FFN: the sandwich placement;
- sliding-window layers beside global ones (`layer_types`; Gemma 3 five to one, Gemma 2 alternating), Gemma 3's
  sliding layers rotated on their own base (`rope_local_base_freq`, 10,000 against 1,000,000);
- head_dim apart from D / H, scores scaled by query_pre_attn_scalar^-1/2, GeGLU with tanh GELU;
- embeddings times sqrt(D); Gemma 2's soft-capped scores (50) and logits (30); Gemma 3's q/k norms;
- RMSNorm as x / rms(x) * (1 + w): qkv's RMSNorm holds 1 + w, added on reading and taken off on writing.
"""
from __future__ import annotations

import torch

from qkv.config import ModelConfig
from qkv.errors import QkvError
from qkv.formats.hf.common import (HF_FAMILIES, HfFamily, Rule, Tensors, activation_from_hf, activation_to_hf,
                                   block_rules, ensure, import_tensors, linear, need, rename)
from qkv.formats.hf.rope import rope_fields, rope_parameters

LAYER_TYPES = {"sliding_attention": "sliding", "full_attention": "global"}  # HF layer_types -> qkv's kinds
GEMMA3 = ("Gemma3ForCausalLM",)
GEMMA2 = ("Gemma2ForCausalLM",)


def layer_types(hf: dict, n_layers: int, gemma3: bool) -> tuple[str, ...]:
    """Each layer's kind: config.json's layer_types, else the pattern of transformers 4.x's configs."""
    types = hf.get("layer_types")
    if types is None:
        pattern = hf.get("sliding_window_pattern", 6 if gemma3 else 2)
        ensure(isinstance(pattern, int) and not isinstance(pattern, bool) and 1 <= pattern <= n_layers,
               f"sliding_window_pattern={pattern!r} must be an integer in 1..num_hidden_layers={n_layers}")
        return tuple("global" if (i + 1) % pattern == 0 else "sliding" for i in range(n_layers))
    if not isinstance(types, list) or len(types) != n_layers or any(t not in LAYER_TYPES for t in types):
        raise QkvError(f"layer_types must list one of {', '.join(LAYER_TYPES)} for each of the {n_layers} layers")
    return tuple(LAYER_TYPES[t] for t in types)


def config(hf: dict, architecture: str) -> ModelConfig:
    gemma3 = hf.get("model_type") in ("gemma3_text", "gemma3")
    d_model, n_heads, n_layers = need(hf, "hidden_size"), need(hf, "num_attention_heads"), need(hf, "num_hidden_layers")
    head_dim = hf.get("head_dim") or d_model // n_heads
    kinds = layer_types(hf, n_layers, gemma3)
    window = hf.get("sliding_window") or 0
    ensure(isinstance(window, int) and window >= 1 or "sliding" not in kinds,
           f"sliding_window={window!r} must be a positive integer: the model has sliding layers")
    ensure(not hf.get("use_bidirectional_attention", False), "use_bidirectional_attention=true (EmbeddingGemma) "
                                                              "is not supported by qkv")
    ensure(not hf.get("attention_bias", False), "attention_bias=true is not supported for Gemma by qkv")
    rope = rope_fields(hf, "full_attention")
    local = rope_fields(hf, "sliding_attention") if isinstance(hf.get("rope_parameters", {}).get("sliding_attention"),
                                                               dict) else None
    if local is not None:
        ensure(local["rope_scaling"] == "none", "a scaled RoPE on the sliding layers is not supported by qkv")
        local_theta = local["rope_theta"]
    else:
        local_theta = float(hf.get("rope_local_base_freq", 0.0)) if gemma3 else 0.0
    softcaps = {key: float(hf.get(key) or 0.0) for key in ("attn_logit_softcapping", "final_logit_softcapping")}
    return ModelConfig(
        arch="decoder", vocab_size=need(hf, "vocab_size"), d_model=d_model, n_heads=n_heads,
        head_size=head_dim if head_dim * n_heads != d_model else 0,
        n_kv_heads=hf.get("num_key_value_heads") or n_heads, n_layers=n_layers, d_ff=need(hf, "intermediate_size"),
        max_seq_len=hf.get("max_position_embeddings", 8192), positional="rope", norm="rmsnorm",
        norm_eps=hf.get("rms_norm_eps", 1e-6), norm_placement="sandwich", ffn="glu",
        activation=activation_from_hf(hf.get("hidden_activation") or hf.get("hidden_act", "gelu_pytorch_tanh"),
                                      "hidden_activation"),
        bias=False, tie_embeddings=hf.get("tie_word_embeddings", True), dropout=0.0, embed_scale=True,
        qk_norm=gemma3, query_scale=float(hf.get("query_pre_attn_scalar") or head_dim),
        attn_softcap=softcaps["attn_logit_softcapping"], logit_softcap=softcaps["final_logit_softcapping"],
        layer_types=kinds if len(set(kinds)) > 1 or kinds[0] != "global" else (),
        sliding_window=window if "sliding" in kinds else 0, rope_local_theta=local_theta if "sliding" in kinds else 0.0,
        **rope)


NORMS = ("attn_norm.inner", "attn_norm.outer", "ffn_norm.inner", "ffn_norm.outer", "attn.q_norm", "attn.k_norm")


def rules(cfg: ModelConfig) -> list[Rule]:
    attn = [pair for name in "qkvo" for pair in linear(f"attn.{name}_proj", f"self_attn.{name}_proj", False)]
    attn += [pair for name in "qk" for pair in linear(f"attn.{name}_norm", f"self_attn.{name}_norm", False)
             if cfg.qk_norm]
    ffn = [pair for name in ("gate", "up", "down") for pair in linear(f"ffn.{name}_proj", f"mlp.{name}_proj", False)]
    norms = [("attn_norm.inner.weight", "input_layernorm.weight"),
             ("attn_norm.outer.weight", "post_attention_layernorm.weight"),
             ("ffn_norm.inner.weight", "pre_feedforward_layernorm.weight"),
             ("ffn_norm.outer.weight", "post_feedforward_layernorm.weight")]
    head = [] if cfg.tie_embeddings else [Rule("lm_head.weight", "lm_head.weight")]
    return ([Rule("tok_emb.weight", "model.embed_tokens.weight")]
            + block_rules(cfg.n_layers, "blocks.", "model.layers.", norms + attn + ffn)
            + [Rule("final_norm.weight", "model.norm.weight")] + head)


def is_norm(qkv_name: str) -> bool:
    return qkv_name == "final_norm.weight" or qkv_name.endswith(tuple(f"{n}.weight" for n in NORMS))


def to_qkv(tensors: Tensors, cfg: ModelConfig) -> Tensors:
    """Gemma's (1 + w) norms become qkv's plain gains."""
    ignored = lambda name: cfg.tie_embeddings and name == "lm_head.weight"  # noqa: E731 - a tied head's copy
    out = import_tensors(tensors, rules(cfg), ignored)
    return {name: gain(t) if is_norm(name) else t for name, t in out.items()}


def gain(w: torch.Tensor) -> torch.Tensor:
    """1 + w; for a shape-only (meta) tensor a new one of its shape, without the arithmetic (torch computes
    a meta tensor's sum in Python code that imports torch._dynamo, 2 s at a GGUF file's load)."""
    return torch.empty(w.shape, device="meta") if w.device.type == "meta" else w + 1


def to_hf(tensors: Tensors, cfg: ModelConfig) -> Tensors:
    return rename({name: t - 1 if is_norm(name) else t for name, t in tensors.items()}, rules(cfg), to_hf=True)


def exports(cfg: ModelConfig, gemma3: bool) -> bool:
    kinds = set(cfg.layer_types) <= {"global", "sliding"}
    return (cfg.arch == "decoder" and cfg.positional == "rope" and cfg.norm == "rmsnorm" and kinds
            and cfg.norm_placement == "sandwich" and cfg.ffn == "glu" and not cfg.moe_experts and not cfg.bias
            and cfg.embed_scale and cfg.qk_norm == gemma3 and not cfg.bigram_vocab
            and (not gemma3 or not cfg.attn_softcap and not cfg.logit_softcap))


def whole(x: float) -> int | float:
    """A number as config.json's integer where it is one (transformers 5 checks query_pre_attn_scalar's type)."""
    return int(x) if float(x).is_integer() else x


def hf_config(cfg: ModelConfig, gemma3: bool) -> tuple[str, dict]:
    ensure(exports(cfg, gemma3), f"not a Gemma {3 if gemma3 else 2} model")
    kinds = cfg.layer_types or ("global",) * cfg.n_layers
    types = [{"sliding": "sliding_attention", "global": "full_attention"}[k] for k in kinds]
    local = {"rope_type": "default", "rope_theta": cfg.rope_local_theta or cfg.rope_theta}
    out = {"model_type": "gemma3_text" if gemma3 else "gemma2", "vocab_size": cfg.vocab_size,
           "hidden_size": cfg.d_model, "intermediate_size": cfg.d_ff, "num_hidden_layers": cfg.n_layers,
           "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.kv_heads, "head_dim": cfg.head_dim,
           "hidden_activation": activation_to_hf(cfg) if cfg.activation != "gelu_tanh" else "gelu_pytorch_tanh",
           "max_position_embeddings": cfg.max_seq_len, "rms_norm_eps": cfg.norm_eps,
           "query_pre_attn_scalar": whole(cfg.query_scale or cfg.head_dim), "sliding_window": cfg.sliding_window or None,
           "layer_types": types, "attention_bias": False, "attention_dropout": 0.0,
           "tie_word_embeddings": cfg.tie_embeddings, "rope_theta": cfg.rope_theta,
           "attn_logit_softcapping": cfg.attn_softcap or None, "final_logit_softcapping": cfg.logit_softcap or None}
    if gemma3:
        out.update(rope_parameters={"full_attention": rope_parameters(cfg), "sliding_attention": local},
                   rope_local_base_freq=local["rope_theta"])
    else:
        ensure(not cfg.rope_local_theta, "Gemma 2 has one RoPE base")
        out.update(rope_parameters=rope_parameters(cfg))
    return (GEMMA3 if gemma3 else GEMMA2)[0], out


HF_FAMILIES.register("gemma3_text")(HfFamily(
    model_type="gemma3_text", architectures=GEMMA3, config=config, to_qkv=to_qkv,
    hf_config=lambda cfg: hf_config(cfg, True), to_hf=to_hf, exports=lambda cfg: exports(cfg, True),
    exports_doc="gemma3_text: decoder, rope, rmsnorm, sandwich, glu, q/k norm, embed_scale"))
HF_FAMILIES.register("gemma2")(HfFamily(
    model_type="gemma2", architectures=GEMMA2, config=config, to_qkv=to_qkv,
    hf_config=lambda cfg: hf_config(cfg, False), to_hf=to_hf, exports=lambda cfg: exports(cfg, False),
    exports_doc="gemma2: decoder, rope, rmsnorm, sandwich, glu, embed_scale, no q/k norm"))
