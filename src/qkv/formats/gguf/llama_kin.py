"""LLaMA's kin in llama.cpp's GGUF layout (convert_hf_to_gguf.py), read (and SmolLM3's LoRA adapters written): SmolLM3
and Phi-3.

smollm3: LLaMA's tensors and Q/K row permutation; every fourth layer has no RoPE, a constant of llama.cpp's
architecture (`n_no_rope_layer_step = 4`), not metadata.
phi3: Q, K and V stored as one `attn_qkv` and gate and up as one `ffn_up` of 2 F rows (the gate first), as
transformers keeps them (`qkv_proj`, `gate_up_proj`), NEOX rope (no permutation); `attention.sliding_window`
as HF's sliding_window (llama.cpp itself runs Phi-3 without the window, which differs only past it). The 128k
models' longrope divisors are the tensors `rope_factors_long` / `_short`, read as settings.
"""
from __future__ import annotations

from qkv.errors import QkvError
from qkv.formats.gguf.archs import (GGUF_ARCHS, LLAMA_BLOCK, LLAMA_TOP, GgufArch, inverse, llama_config, llama_from_hf,
                                    llama_to_hf, need, renaming)

NO_ROPE_STEP = 4  # llama.cpp's smollm3: layer il has RoPE unless (il + 1) % 4 == 0


def smollm3_config(meta: dict, shapes: dict) -> dict:
    hf = llama_config(meta, shapes, "smollm3")
    return {**hf, "no_rope_layers": [int((i + 1) % NO_ROPE_STEP != 0) for i in range(hf["num_hidden_layers"])]}


GGUF_ARCHS.register("smollm3")(GgufArch(hf_config=smollm3_config, hf_name=renaming(LLAMA_TOP, LLAMA_BLOCK, "model.layers."),
                                        to_hf=llama_to_hf, gguf_name=inverse(LLAMA_TOP, LLAMA_BLOCK, "model.layers."),
                                        from_hf=llama_from_hf))  # (names for adapters; no model written)

PHI3_BLOCK = {"attn_norm": "input_layernorm", "attn_qkv": "self_attn.qkv_proj", "attn_output": "self_attn.o_proj",
              "ffn_norm": "post_attention_layernorm", "ffn_up": "mlp.gate_up_proj", "ffn_down": "mlp.down_proj"}


def phi3_config(meta: dict, shapes: dict) -> dict:
    arch = "phi3"
    d_model, n_heads = int(need(meta, f"{arch}.embedding_length")), int(need(meta, f"{arch}.attention.head_count"))
    head_dim = d_model // n_heads
    rotated = int(meta.get(f"{arch}.rope.dimension_count", head_dim))  # llama.cpp's n_rot: each head's first
    hf = {**llama_config(meta, shapes, arch), "head_dim": head_dim}  # dimensions turned (Phi-4-mini: 3/4)
    window = int(meta.get(f"{arch}.attention.sliding_window", 0) or 0)
    return {**hf, "sliding_window": window or None, "partial_rotary_factor": rotated / head_dim,
            **longrope(meta, hf["rope_theta"])}


def longrope(meta: dict, theta: float) -> dict:
    """Phi-3 128k's longrope as llama.cpp's converter stores it: the divisors as the tensors rope_factors_long and
    rope_factors_short, the original context and the cos / sin factor as metadata."""
    sets = [meta.get(f"rope_factors_{which}.weight") for which in ("long", "short")]
    if sets[0] is None and sets[1] is None:
        return {}
    if sets[0] is None or sets[1] is None:
        raise QkvError("rope_factors_long and rope_factors_short come together (Phi-3's longrope)")
    original = int(need(meta, "phi3.rope.scaling.original_context_length"))
    return {"rope_parameters": {"rope_type": "longrope", "rope_theta": theta,
                                "long_factor": [float(f) for f in sets[0].reshape(-1)],
                                "short_factor": [float(f) for f in sets[1].reshape(-1)],
                                "original_max_position_embeddings": original,
                                "attention_factor": float(meta.get("phi3.rope.scaling.attn_factor", 1.0))}}


GGUF_ARCHS.register("phi3")(GgufArch(hf_config=phi3_config, hf_name=renaming(LLAMA_TOP, PHI3_BLOCK, "model.layers."),
                                     to_hf=lambda name, w, hf: w,
                                     settings=("rope_factors_long.weight", "rope_factors_short.weight")))
