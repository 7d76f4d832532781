"""Qwen3 (transformers' modeling_qwen3.py), Mistral and SmolLM3 <-> qkv's decoder LM: LLaMA's layout with a
difference each.

Qwen3: no biases, each head's q and k RMS-normalised before RoPE (model.qk_norm, gains self_attn.q_norm and
k_norm), and head_dim apart from D / H (Qwen3-0.6B: 1,024 wide, 16 heads of 128: model.head_size).
Mistral: LLaMA's tensors; a `sliding_window` (Mistral 7B v0.1: 4,096 keys) makes every layer sliding.
SmolLM3: LLaMA's tensors; `no_rope_layers` (0 where a layer has no RoPE: every fourth) makes those layers nope.
"""
from __future__ import annotations

from dataclasses import replace

from qkv.config import ModelConfig
from qkv.formats.hf import llama
from qkv.formats.hf.common import HF_FAMILIES, HfFamily, ensure

QWEN3, MISTRAL, SMOLLM3 = "Qwen3ForCausalLM", "MistralForCausalLM", "SmolLM3ForCausalLM"


def qwen3_config(hf: dict, architecture: str) -> ModelConfig:
    ensure(not hf.get("use_sliding_window", False), "use_sliding_window=true: Qwen3's sliding-window layers are "
                                                    "not supported by qkv")
    return llama.config(hf, architecture, qk_norm=True)


def qwen3_exports(cfg: ModelConfig) -> bool:
    return llama.exports(replace(cfg, qk_norm=False)) and cfg.qk_norm and not cfg.bias


def qwen3_hf_config(cfg: ModelConfig) -> tuple[str, dict]:
    ensure(qwen3_exports(cfg), "not a Qwen3 model")
    _, out = llama.hf_config(replace(cfg, qk_norm=False))
    return QWEN3, {**out, "model_type": "qwen3", "use_sliding_window": False}


def mistral_config(hf: dict, architecture: str) -> ModelConfig:
    window = hf.get("sliding_window") or 0
    ensure(isinstance(window, int) and window >= 0, f"sliding_window={window!r} must be a positive integer or null")
    n_layers = hf.get("num_hidden_layers") or 0
    sliding = {"layer_types": ("sliding",) * n_layers, "sliding_window": window} if window else {}
    return llama.config(hf, architecture, **sliding)


def smollm3_config(hf: dict, architecture: str) -> ModelConfig:
    ensure(not hf.get("use_sliding_window", False), "use_sliding_window=true: SmolLM3's sliding-window layers are "
                                                    "not supported by qkv")
    n_layers = hf.get("num_hidden_layers") or 0
    interval = hf.get("no_rope_layer_interval", 4)
    flags = hf.get("no_rope_layers") or [int((i + 1) % interval != 0) for i in range(n_layers)]
    ensure(isinstance(flags, list) and len(flags) == n_layers and all(f in (0, 1) for f in flags),
           f"no_rope_layers must give 1 (RoPE) or 0 (none) for each of the {n_layers} layers")
    kinds = tuple("global" if f else "nope" for f in flags)
    return llama.config(hf, architecture, layer_types=kinds if "nope" in kinds else ())


def smollm3_exports(cfg: ModelConfig) -> bool:
    return (set(cfg.layer_types) <= {"global", "nope"} and "nope" in cfg.layer_types
            and llama.exports(replace(cfg, layer_types=())))


def smollm3_hf_config(cfg: ModelConfig) -> tuple[str, dict]:
    ensure(smollm3_exports(cfg), "not a SmolLM3 model")
    _, out = llama.hf_config(replace(cfg, layer_types=()))
    flags = [0 if kind == "nope" else 1 for kind in cfg.layer_types]
    return SMOLLM3, {**out, "model_type": "smollm3", "no_rope_layers": flags, "use_sliding_window": False,
                     "pad_token_id": None}  # (its class defaults to a row of its own 128k vocabulary)


HF_FAMILIES.register("smollm3")(HfFamily(
    model_type="smollm3", architectures=(SMOLLM3,), config=smollm3_config, to_qkv=llama.to_qkv,
    hf_config=smollm3_hf_config, to_hf=llama.to_hf, exports=smollm3_exports,
    exports_doc="smollm3: llama with nope layers"))
HF_FAMILIES.register("qwen3")(HfFamily(
    model_type="qwen3", architectures=(QWEN3,), config=qwen3_config, to_qkv=llama.to_qkv, hf_config=qwen3_hf_config,
    to_hf=llama.to_hf, exports=qwen3_exports, exports_doc="qwen3: llama with q/k norm, no biases"))
def mistral_exports(cfg: ModelConfig) -> bool:
    return (bool(cfg.layer_types) and set(cfg.layer_types) == {"sliding"} and not cfg.rope_local_theta
            and llama.exports(replace(cfg, layer_types=(), sliding_window=0)))


def mistral_hf_config(cfg: ModelConfig) -> tuple[str, dict]:
    ensure(mistral_exports(cfg), "not a Mistral model")
    _, out = llama.hf_config(replace(cfg, layer_types=(), sliding_window=0))
    return MISTRAL, {**out, "model_type": "mistral", "sliding_window": cfg.sliding_window}


HF_FAMILIES.register("mistral")(HfFamily(
    model_type="mistral", architectures=(MISTRAL,), config=mistral_config, to_qkv=llama.to_qkv,
    hf_config=mistral_hf_config, to_hf=llama.to_hf, exports=mistral_exports,
    exports_doc="mistral: llama with every layer sliding"))
