"""Gemma 2 and Gemma 3 (text) in llama.cpp's GGUF layout (convert_hf_to_gguf.py), read and (Gemma 3) written.

Four norms a block, stored as 1 + w (HF keeps w); NEOX rope (no row permutation); the layer pattern and the
sliding layers' RoPE base are llama.cpp's constants for the architecture (Gemma 3: every sixth layer global,
sliding layers at base 10,000; Gemma 2: alternating), not metadata, unless a newer converter wrote
`attention.sliding_window_pattern` (one flag a layer) or `rope.freq_base_swa`. A Gemma 3 written by qkv must be
one llama.cpp reads as such: its pattern llama.cpp's, its local base written, its scores scaled by head_dim^-1/2.
"""
from __future__ import annotations

import functools

import numpy as np

from qkv.errors import QkvError
from qkv.formats.gguf.archs import GGUF_ARCHS, LLAMA_BLOCK, LLAMA_TOP, GgufArch, inverse, need, renaming

GEMMA_BLOCK = {"attn_norm": "input_layernorm", "post_attention_norm": "post_attention_layernorm",
               "ffn_norm": "pre_feedforward_layernorm", "post_ffw_norm": "post_feedforward_layernorm",
               "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
               **{k: v for k, v in LLAMA_BLOCK.items() if k not in ("attn_norm", "ffn_norm")}}
GEMMA_PATTERN = {"gemma3": 6, "gemma2": 2}  # every n-th layer global (llama.cpp's swa pattern)
WIDE_SCALE = {"gemma3": 62, "gemma2": 46}  # the layer count of the 27B models, scaled by (D / H)^-1/2


def gemma_config(meta: dict, shapes: dict, arch: str) -> dict:
    d_model, n_heads = int(need(meta, f"{arch}.embedding_length")), int(need(meta, f"{arch}.attention.head_count"))
    layers = int(need(meta, f"{arch}.block_count"))
    head_dim = int(meta.get(f"{arch}.attention.key_length", d_model // n_heads))
    if int(meta.get(f"{arch}.attention.value_length", head_dim)) != head_dim:
        raise QkvError(f"{arch}.attention.value_length differs from key_length: qkv has one head width")
    pattern = meta.get(f"{arch}.attention.sliding_window_pattern", GEMMA_PATTERN[arch])
    if isinstance(pattern, (list, tuple)):  # one flag a layer (newer converters): True where it slides
        if len(pattern) != layers or not all(isinstance(p, bool) for p in pattern):
            raise QkvError(f"{arch}.attention.sliding_window_pattern has {len(pattern)} entries for {layers} layers: "
                           "one true / false a layer")
        types = ["sliding_attention" if p else "full_attention" for p in pattern]
    elif isinstance(pattern, int) and not isinstance(pattern, bool) and pattern >= 1:  # every n-th global
        types = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(layers)]
    else:  # (n past the last layer: every layer slides, as in llama.cpp)
        raise QkvError(f"{arch}.attention.sliding_window_pattern={pattern!r} must be a whole number of layers, at "
                       "least 1")
    window = int(need(meta, f"{arch}.attention.sliding_window"))
    if window < 1:
        raise QkvError(f"{arch}.attention.sliding_window={window}: a window of no keys")
    # llama.cpp scales the 27B models' scores (Gemma 2: 46 layers, Gemma 3: 62) by (D / H)^-1/2, every other
    # Gemma's by head_dim^-1/2
    scalar = d_model // n_heads if layers == WIDE_SCALE[arch] else head_dim
    full = {"rope_type": "default", "rope_theta": float(meta.get(f"{arch}.rope.freq_base", 10000.0))}
    # the sliding layers' base: rope.freq_base_swa where the converter wrote it, else llama.cpp's default for the
    # architecture (Gemma 3: 10,000; Gemma 2: the global base, one base for all layers)
    local = float(meta.get(f"{arch}.rope.freq_base_swa", 10000.0 if arch == "gemma3" else full["rope_theta"]))
    if arch == "gemma2" and local != full["rope_theta"]:
        raise QkvError(f"gemma2.rope.freq_base_swa={local:g} differs from rope.freq_base: Gemma 2 has one RoPE base "
                       "for all layers in qkv")
    scaling = meta.get(f"{arch}.rope.scaling.type", "none")
    if scaling == "linear":
        full = {**full, "rope_type": "linear", "factor": float(need(meta, f"{arch}.rope.scaling.factor"))}
    elif scaling not in ("none", None):
        raise QkvError(f"{arch}.rope.scaling.type={scaling!r} is not supported by qkv for {arch} (none, linear)")
    hf = {"model_type": "gemma3_text" if arch == "gemma3" else "gemma2",
          "architectures": ["Gemma3ForCausalLM" if arch == "gemma3" else "Gemma2ForCausalLM"],
          "vocab_size": shapes["token_embd.weight"][0], "hidden_size": d_model,
          "intermediate_size": int(need(meta, f"{arch}.feed_forward_length")), "num_hidden_layers": layers,
          "num_attention_heads": n_heads, "num_key_value_heads": int(meta.get(f"{arch}.attention.head_count_kv", n_heads)),
          "head_dim": head_dim, "max_position_embeddings": int(meta.get(f"{arch}.context_length", 8192)),
          "rms_norm_eps": float(need(meta, f"{arch}.attention.layer_norm_rms_epsilon")),
          "hidden_activation": "gelu_pytorch_tanh", "query_pre_attn_scalar": scalar, "sliding_window": window,
          "layer_types": types, "tie_word_embeddings": "output.weight" not in shapes,
          "attn_logit_softcapping": meta.get(f"{arch}.attn_logit_softcapping"),
          "final_logit_softcapping": meta.get(f"{arch}.final_logit_softcapping")}
    if arch == "gemma3":
        hf["rope_parameters"] = {"full_attention": full, "sliding_attention": {"rope_type": "default", "rope_theta": local}}
    else:
        hf["rope_parameters"] = full
    return hf


def gemma_to_hf(hf_name: str, w: np.ndarray, hf: dict) -> np.ndarray:
    """llama.cpp stores Gemma's norm gains as 1 + w: HF's w."""
    return w - np.float32(1.0) if hf_name.endswith("norm.weight") else w


def gemma_from_hf(hf_name: str, w: np.ndarray, hf: dict) -> np.ndarray:
    return w + np.float32(1.0) if hf_name.endswith("norm.weight") else w


def gemma3_metadata(hf: dict) -> dict:
    """The metadata of a Gemma 3 llama.cpp reads as the same model (module docstring)."""
    layers, head_dim = hf["num_hidden_layers"], hf["head_dim"]
    pattern = ["full_attention" if (i + 1) % GEMMA_PATTERN["gemma3"] == 0 else "sliding_attention" for i in range(layers)]
    local = hf["rope_parameters"]["sliding_attention"]["rope_theta"]
    full = hf["rope_parameters"]["full_attention"]
    scalar = hf["hidden_size"] // hf["num_attention_heads"] if layers == WIDE_SCALE["gemma3"] else head_dim
    if hf["layer_types"] != pattern or hf["query_pre_attn_scalar"] != scalar:
        raise QkvError("this Gemma 3 has a layer pattern or score scale llama.cpp would not read back (it keeps one "
                       "global layer in six and head_dim^-1/2)")
    out = {"context_length": hf["max_position_embeddings"], "embedding_length": hf["hidden_size"],
           "block_count": layers, "feed_forward_length": hf["intermediate_size"],
           "attention.head_count": hf["num_attention_heads"], "attention.head_count_kv": hf["num_key_value_heads"],
           "attention.key_length": head_dim, "attention.value_length": head_dim,
           "attention.layer_norm_rms_epsilon": float(hf["rms_norm_eps"]), "rope.freq_base": float(full["rope_theta"]),
           "rope.freq_base_swa": float(local), "attention.sliding_window": hf["sliding_window"],
           "vocab_size": hf["vocab_size"]}
    if full.get("rope_type", "default") == "linear":
        out.update({"rope.scaling.type": "linear", "rope.scaling.factor": float(full["factor"])})
    elif full.get("rope_type", "default") != "default":
        raise QkvError(f"a Gemma 3 with {full['rope_type']} RoPE scaling has no GGUF form in qkv")
    return out


for _arch in GEMMA_PATTERN:
    _writes = _arch == "gemma3"
    GGUF_ARCHS.register(_arch)(GgufArch(
        hf_config=functools.partial(gemma_config, arch=_arch), hf_name=renaming(LLAMA_TOP, GEMMA_BLOCK, "model.layers."),
        to_hf=gemma_to_hf, gguf_name=inverse(LLAMA_TOP, GEMMA_BLOCK, "model.layers.") if _writes else None,
        from_hf=gemma_from_hf if _writes else None, metadata=gemma3_metadata if _writes else None))
