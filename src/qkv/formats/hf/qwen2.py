"""Qwen2 (transformers' modeling_qwen2.py) <-> qkv's decoder LM: LLaMA's shape (RoPE rotate-half, RMSNorm,
SwiGLU, GQA) with biases on the Q, K and V projections only.

qkv has one `model.bias` for every linear layer, so a Qwen2 model is read with bias=True and the biases it does
not have (the output projection's and the FFN's) are zeros: the same function, with 2 D + 2 F zero
parameters per layer more than Qwen2 counts (docs/DEVIATIONS.md). qkv writes such a model as LLaMA with
biases (`attention_bias`, `mlp_bias`), the same function in transformers' LlamaForCausalLM.
"""
from __future__ import annotations

import torch

from qkv.config import ModelConfig
from qkv.formats.hf import llama
from qkv.formats.hf.common import HF_FAMILIES, HfFamily, Tensors, ensure

ARCHITECTURE = "Qwen2ForCausalLM"
ABSENT = ("attn.o_proj.bias", "ffn.gate_proj.bias", "ffn.up_proj.bias", "ffn.down_proj.bias")  # zero in qkv


def config(hf: dict, architecture: str) -> ModelConfig:
    ensure(not hf.get("use_sliding_window", False), "use_sliding_window=true: Qwen2's sliding-window layers are "
                                                    "not supported by qkv")
    return llama.config({**hf, "attention_bias": True, "mlp_bias": True}, architecture)


def absent(name: str) -> bool:
    return name.endswith(ABSENT)


def to_qkv(tensors: Tensors, cfg: ModelConfig) -> Tensors:
    """The Qwen2 checkpoint with zero biases where it has none, then LLaMA's renaming with biases."""
    full = dict(tensors)
    for rule in llama.rules(cfg):
        if absent(rule.qkv) and rule.hf not in full:
            weight = full.get(rule.hf.removesuffix(".bias") + ".weight")  # absent too: the renaming names it
            if weight is not None:
                full[rule.hf] = torch.zeros(weight.shape[0], dtype=weight.dtype)
    return llama.to_qkv(full, cfg)


HF_FAMILIES.register("qwen2")(HfFamily(
    model_type="qwen2", architectures=(ARCHITECTURE,), config=config, to_qkv=to_qkv, hf_config=None, to_hf=None,
    exports=lambda cfg: False, exports_doc="qwen2: read only (qkv writes its shape as llama with biases)"))
