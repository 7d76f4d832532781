"""Qwen3 (transformers' modeling_qwen3.py) and Mistral <-> qkv's decoder LM: LLaMA's layout with a difference each.

Qwen3: no biases, each head's q and k RMS-normalised before RoPE (model.qk_norm, gains self_attn.q_norm and
k_norm), and head_dim apart from D / H (Qwen3-0.6B: 1,024 wide, 16 heads of 128: model.head_size).
Mistral: LLaMA's tensors; a `sliding_window` (Mistral 7B v0.1: 4,096 keys) makes every layer sliding.
"""
from __future__ import annotations

from dataclasses import replace

from qkv.config import ModelConfig
from qkv.formats.hf import llama
from qkv.formats.hf.common import HF_FAMILIES, HfFamily, ensure

QWEN3, MISTRAL = "Qwen3ForCausalLM", "MistralForCausalLM"


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


HF_FAMILIES.register("qwen3")(HfFamily(
    model_type="qwen3", architectures=(QWEN3,), config=qwen3_config, to_qkv=llama.to_qkv, hf_config=qwen3_hf_config,
    to_hf=llama.to_hf, exports=qwen3_exports, exports_doc="qwen3: llama with q/k norm, no biases"))
HF_FAMILIES.register("mistral")(HfFamily(
    model_type="mistral", architectures=(MISTRAL,), config=mistral_config, to_qkv=llama.to_qkv, hf_config=None,
    to_hf=None, exports=lambda cfg: False, exports_doc="mistral: read only (qkv writes its shape as llama)"))
