"""LLaMA (Touvron et al. 2023; transformers' modeling_llama.py) <-> qkv's decoder LM.

RoPE (rotate-half layout, the same as qkv's: no permutation of q/k rows), RMSNorm, SwiGLU, GQA by
`num_key_value_heads`, no biases, tied or untied head. Every tensor is a pure rename.
"""
from __future__ import annotations

from dataclasses import replace

from qkv.config import ModelConfig
from qkv.formats.hf.common import (HF_FAMILIES, HfFamily, Rule, Tensors, activation_from_hf, activation_to_hf, block_rules,
                           ensure, import_tensors, linear, need, plain, refuse, rename)
from qkv.formats.hf.rope import rope_fields, rope_parameters

ARCHITECTURE = "LlamaForCausalLM"


def config(hf: dict, architecture: str, **fields) -> ModelConfig:
    """LLaMA's config (Llama 2 and 3.x with its RoPE scaling; SmolLM2, TinyLlama, Mistral's layout without
    its window); `fields`: what a family built on it sets beyond (Qwen3's q/k norm)."""
    d_model, n_heads = need(hf, "hidden_size"), need(hf, "num_attention_heads")
    head_dim = hf.get("head_dim") or d_model // n_heads
    bias = hf.get("attention_bias", False)
    ensure(bias == hf.get("mlp_bias", False), "attention_bias != mlp_bias: qkv has one model.bias")
    refuse(hf, "pretraining_tp", 1, "tensor-parallel pretraining slices")
    return ModelConfig(**{
        "arch": "decoder", "vocab_size": need(hf, "vocab_size"), "d_model": d_model, "n_heads": n_heads,
        "head_size": head_dim if head_dim * n_heads != d_model else 0,
        "n_kv_heads": hf.get("num_key_value_heads") or n_heads, "n_layers": need(hf, "num_hidden_layers"),
        "d_ff": need(hf, "intermediate_size"), "max_seq_len": hf.get("max_position_embeddings", 2048),
        "positional": "rope", "norm": "rmsnorm", "norm_eps": hf.get("rms_norm_eps", 1e-6),
        "norm_placement": "pre", "ffn": "glu",
        "activation": activation_from_hf(hf.get("hidden_act", "silu"), "hidden_act"),
        "bias": bias, "tie_embeddings": hf.get("tie_word_embeddings", False), "dropout": 0.0,
        **rope_fields(hf), **fields})


def rules(cfg: ModelConfig) -> list[Rule]:
    attn = [pair for name in "qkvo" for pair in linear(f"attn.{name}_proj", f"self_attn.{name}_proj", cfg.bias)]
    attn += [pair for name in "qk" for pair in linear(f"attn.{name}_norm", f"self_attn.{name}_norm", False)
             if cfg.qk_norm]  # Qwen3, OLMo 2
    ffn = [pair for name in ("gate", "up", "down") for pair in linear(f"ffn.{name}_proj", f"mlp.{name}_proj", cfg.bias)]
    pairs = (linear("attn_norm", "input_layernorm", False) + attn
             + linear("ffn_norm", "post_attention_layernorm", False) + ffn)
    head = [] if cfg.tie_embeddings else [Rule("lm_head.weight", "lm_head.weight")]
    return ([Rule("tok_emb.weight", "model.embed_tokens.weight")]
            + block_rules(cfg.n_layers, "blocks.", "model.layers.", pairs)
            + [Rule("final_norm.weight", "model.norm.weight")] + head)


def ignored(cfg: ModelConfig):
    def check(name: str) -> bool:  # RoPE tables of old checkpoints; a tied head's duplicate
        return name.endswith("rotary_emb.inv_freq") or (cfg.tie_embeddings and name == "lm_head.weight")
    return check


def to_qkv(tensors: Tensors, cfg: ModelConfig) -> Tensors:
    return import_tensors(tensors, rules(cfg), ignored(cfg))


def to_hf(tensors: Tensors, cfg: ModelConfig) -> Tensors:
    return rename(tensors, rules(cfg), to_hf=True)


def exports(cfg: ModelConfig) -> bool:
    return (cfg.arch == "decoder" and cfg.positional == "rope" and cfg.norm == "rmsnorm"
            and cfg.norm_placement == "pre" and cfg.ffn == "glu" and not cfg.moe_experts and not cfg.embed_scale
            and plain(replace(cfg, head_size=0, rope_scaling="none")))  # LLaMA's config says both


def hf_config(cfg: ModelConfig) -> tuple[str, dict]:
    ensure(exports(cfg), "not a LLaMA model")
    return ARCHITECTURE, {
        "model_type": "llama", "vocab_size": cfg.vocab_size, "hidden_size": cfg.d_model,
        "intermediate_size": cfg.d_ff, "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.kv_heads, "head_dim": cfg.head_dim, "hidden_act": activation_to_hf(cfg),
        "max_position_embeddings": cfg.max_seq_len, "rms_norm_eps": cfg.norm_eps,
        "rope_parameters": rope_parameters(cfg), "rope_theta": cfg.rope_theta,  # transformers 4.x reads rope_theta
        **({"rope_scaling": rope_parameters(cfg)} if cfg.rope_scaling != "none" else {}),  # and this
        "attention_bias": cfg.bias, "mlp_bias": cfg.bias, "attention_dropout": cfg.dropout,
        "tie_word_embeddings": cfg.tie_embeddings}


HF_FAMILIES.register("llama")(HfFamily(
    model_type="llama", architectures=(ARCHITECTURE,), config=config, to_qkv=to_qkv, hf_config=hf_config,
    to_hf=to_hf, exports=exports, exports_doc="llama: decoder, rope, rmsnorm, pre, glu"))
