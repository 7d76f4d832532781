"""gpt-oss in llama.cpp's GGUF layout (architecture `gpt-oss`, convert_hf_to_gguf.py's GptOssModel), read as the
Hugging Face checkpoint it came from (qkv.formats.hf.gpt_oss maps that).

The converter splits transformers' interleaved gate_up_proj into ffn_gate_exps and ffn_up_exps (E, F, D), each with
its bias (E, F), keeps ffn_down_exps (E, D, F) and its bias (E, D), the router as ffn_gate_inp (weight and bias), each
head's sink as attn_sinks.weight, and the pre-FFN norm as post_attention_norm; the experts are MXFP4 in the released
files, which the `gguf` package dequantizes. Layers alternate sliding (first) and global, as llama.cpp's
gpt-oss pattern of 2 does. RoPE is read as the model defines it, YaRN's ramp unrounded (truncate: false, as
transformers' config and OpenAI's code); llama.cpp rounds it, which moves a few pairs' frequencies.
"""
from __future__ import annotations

import numpy as np

from qkv.formats.gguf.archs import GGUF_ARCHS, LLAMA_TOP, GgufArch, need, renaming

BLOCK = {"attn_norm": "input_layernorm", "post_attention_norm": "post_attention_layernorm",
         "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
         "attn_output": "self_attn.o_proj", "ffn_gate_inp": "mlp.router", "ffn_gate_exps": "mlp.experts.gate_proj",
         "ffn_up_exps": "mlp.experts.up_proj", "ffn_down_exps": "mlp.experts.down_proj"}
hf_name = renaming(LLAMA_TOP, BLOCK, "model.layers.", {"attn_sinks.weight": "self_attn.sinks"})


def hf_config(meta: dict, shapes: dict) -> dict:
    arch = "gpt-oss"
    n_layers = int(need(meta, f"{arch}.block_count"))
    d_model, n_heads = int(need(meta, f"{arch}.embedding_length")), int(need(meta, f"{arch}.attention.head_count"))
    hf = {"model_type": "gpt_oss", "architectures": ["GptOssForCausalLM"], "vocab_size": shapes["token_embd.weight"][0],
          "hidden_size": d_model, "num_hidden_layers": n_layers, "num_attention_heads": n_heads,
          "num_key_value_heads": int(meta.get(f"{arch}.attention.head_count_kv", n_heads)),
          "head_dim": int(meta.get(f"{arch}.attention.key_length", d_model // n_heads)),
          "intermediate_size": int(need(meta, f"{arch}.expert_feed_forward_length")),
          "num_local_experts": int(need(meta, f"{arch}.expert_count")),
          "num_experts_per_tok": int(need(meta, f"{arch}.expert_used_count")),
          "sliding_window": int(need(meta, f"{arch}.attention.sliding_window")),
          "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n_layers)],
          "max_position_embeddings": int(meta.get(f"{arch}.context_length", 4096)),
          "rms_norm_eps": float(need(meta, f"{arch}.attention.layer_norm_rms_epsilon")),
          "attention_bias": True, "tie_word_embeddings": "output.weight" not in shapes}
    theta = float(meta.get(f"{arch}.rope.freq_base", 10000.0))
    if meta.get(f"{arch}.rope.scaling.type") == "yarn":
        hf["rope_parameters"] = {"rope_type": "yarn", "rope_theta": theta,
                                 "factor": float(need(meta, f"{arch}.rope.scaling.factor")),
                                 "original_max_position_embeddings":
                                     int(need(meta, f"{arch}.rope.scaling.original_context_length")),
                                 "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False}
    else:
        hf["rope_parameters"] = {"rope_type": "default", "rope_theta": theta}
    return hf


def to_hf(name: str, w: np.ndarray, hf: dict) -> np.ndarray:
    return w


GGUF_ARCHS.register("gpt-oss")(GgufArch(hf_config=hf_config, hf_name=hf_name, to_hf=to_hf))
