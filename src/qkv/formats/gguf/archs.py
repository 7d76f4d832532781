"""Each GGUF architecture as the Hugging Face checkpoint it was converted from: its config.json keys from the
metadata, and its tensors under their HF names with llama.cpp's changes undone. qkv then reads that with the
HF family's own mapping (qkv.formats.hf), so one set of renaming rules serves both formats: llama (SmolLM,
TinyLlama, the Llama 2 and 3 layouts), qwen2 (read only) and gpt2 (whose Conv1D weights llama.cpp stores
transposed).

llama.cpp's converter (convert_hf_to_gguf.py) permutes the rows of LLaMA's Q and K weights so that each
rotary pair (i, i + Dh/2) of HF's rotate-half layout sits side by side (i, i + 1), the layout of ggml's
rope kernel; `unpermute` puts them back (and `permute` is its inverse, for writing).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from qkv.errors import QkvError
from qkv.registry import Registry
from qkv.rope_scaling import RopeScaling, base_frequencies, llama3


@dataclass(frozen=True)
class GgufArch:
    hf_config: Callable[[dict, dict], dict]  # (metadata, tensor shapes) -> an HF config.json dict
    hf_name: Callable[[str], str | None]  # GGUF tensor name -> HF name (None: not a tensor qkv reads)
    to_hf: Callable[[str, np.ndarray, dict], np.ndarray]  # (HF name, tensor, HF config) -> the HF tensor
    # writing (None: qkv reads this architecture only): the inverses, and the metadata of an HF config dict
    gguf_name: Callable[[str], str] | None = None  # HF name -> GGUF name
    from_hf: Callable[[str, np.ndarray, dict], np.ndarray] | None = None  # (HF name, HF tensor, HF config) -> stored
    metadata: Callable[[dict], dict] | None = None  # HF config.json dict -> {GGUF key without the arch prefix: value}
    # tensors that are settings rather than weights, handed to hf_config among the metadata as arrays (llama's
    # rope_freqs.weight), and settings(hf) -> {name: array} writes them
    settings: tuple[str, ...] = ()
    write_settings: Callable[[dict], dict] | None = None


GGUF_ARCHS: Registry[GgufArch] = Registry("GGUF architecture")
GGUF_NAMES = {"gemma3_text": "gemma3", "mixtral": "llama", "qwen3_moe": "qwen3moe"}  # llama.cpp's name of an HF
# model_type where the two differ

LLAMA_BLOCK = {"attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
               "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "ffn_norm": "post_attention_layernorm",
               "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
LLAMA_TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
# an MoE layer's router and stacked experts (E, out, in) under an FFN module's name (qkv.formats.hf.moe stacks
# and splits them); a llama file with experts is Mixtral
MOE_BLOCK = {"ffn_gate_inp": "gate", "ffn_gate_exps": "experts.gate_proj", "ffn_up_exps": "experts.up_proj",
             "ffn_down_exps": "experts.down_proj"}
MIXTRAL_BLOCK = {**LLAMA_BLOCK, **{gguf: f"block_sparse_moe.{hf}" for gguf, hf in MOE_BLOCK.items()}}


def need(meta: dict, key: str):
    if key not in meta:
        raise QkvError(f"metadata has no {key!r}, which this architecture needs")
    return meta[key]


def llama_config(meta: dict, shapes: dict, arch: str = "llama") -> dict:
    d_model, n_heads = int(need(meta, f"{arch}.embedding_length")), int(need(meta, f"{arch}.attention.head_count"))
    vocab = shapes["token_embd.weight"][0]
    model_type, architecture = {"llama": ("llama", "LlamaForCausalLM"), "qwen2": ("qwen2", "Qwen2ForCausalLM"),
                                "qwen3": ("qwen3", "Qwen3ForCausalLM"), "smollm3": ("smollm3", "SmolLM3ForCausalLM"),
                                "phi3": ("phi3", "Phi3ForCausalLM"), "qwen3moe": ("qwen3_moe", "Qwen3MoeForCausalLM"),
                                "olmoe": ("olmoe", "OlmoeForCausalLM")}[arch]
    experts = experts_of(meta, arch)
    if experts and arch == "llama":
        model_type, architecture = "mixtral", "MixtralForCausalLM"
    return {"model_type": model_type, "architectures": [architecture], "vocab_size": vocab, "hidden_size": d_model,
            "intermediate_size": int(need(meta, f"{arch}.feed_forward_length")),
            "num_hidden_layers": int(need(meta, f"{arch}.block_count")), "num_attention_heads": n_heads,
            "num_key_value_heads": int(meta.get(f"{arch}.attention.head_count_kv", n_heads)),
            "head_dim": int(meta.get(f"{arch}.rope.dimension_count", d_model // n_heads)),
            "max_position_embeddings": int(meta.get(f"{arch}.context_length", 2048)),
            "rms_norm_eps": float(need(meta, f"{arch}.attention.layer_norm_rms_epsilon")),
            "rope_theta": float(meta.get(f"{arch}.rope.freq_base", 10000.0)), "hidden_act": "silu",
            "tie_word_embeddings": "output.weight" not in shapes, **rope_scaling(meta, arch), **experts}


def experts_of(meta: dict, arch: str) -> dict:
    """config.json's expert count and k from `{arch}.expert_count` / `expert_used_count` ({} without experts)."""
    experts = int(meta.get(f"{arch}.expert_count", 0) or 0)
    if not experts:
        return {}
    return {"num_local_experts": experts, "num_experts_per_tok": int(need(meta, f"{arch}.expert_used_count"))}


def experts_metadata(hf: dict) -> dict:
    experts = hf.get("num_local_experts") or hf.get("num_experts")
    return {"expert_count": experts, "expert_used_count": hf["num_experts_per_tok"]} if experts else {}


LLAMA3_SETTINGS = [(8192, 1.0, 4.0)]  # (original context, low, high) of Llama 3.1-3.3 and 3.2's releases


def rope_scaling(meta: dict, arch: str) -> dict:
    """config.json's rope_scaling from `{arch}.rope.scaling.*`, or from llama.cpp's rope_freqs.weight: the
    divisor f_i of each pair's frequency (Llama 3.x's llama3 scaling, written by the converter as a tensor and
    no metadata), matched against the llama3 settings of the releases (qkv.rope_scaling.llama3)."""
    kind = meta.get(f"{arch}.rope.scaling.type", "none")
    if kind == "linear":
        return {"rope_scaling": {"rope_type": "linear", "factor": float(need(meta, f"{arch}.rope.scaling.factor"))}}
    if kind == "yarn":
        return {"rope_scaling": {"rope_type": "yarn", "factor": float(need(meta, f"{arch}.rope.scaling.factor")),
                                 "original_max_position_embeddings":
                                     int(need(meta, f"{arch}.rope.scaling.original_context_length"))}}
    if kind not in ("none", None):
        raise QkvError(f"{arch}.rope.scaling.type={kind!r}: this RoPE scaling is not supported by qkv "
                       "(none, linear, yarn, llama3 by rope_freqs.weight)")
    divisors = meta.get("rope_freqs.weight")
    if divisors is None:
        return {}
    divisors = np.asarray(divisors, dtype=np.float64).reshape(-1)
    head_dim = int(meta.get(f"{arch}.rope.dimension_count", 0)) or 2 * divisors.size
    if divisors.size != head_dim // 2 or not np.all(np.isfinite(divisors)) or divisors.min() <= 0:
        raise QkvError(f"rope_freqs.weight has {divisors.size} entries for a head of {head_dim}: one positive "
                       "divisor per rotated pair")
    if np.all(divisors == 1.0):  # every pair kept: no scaling at all
        return {}
    theta = base_frequencies(head_dim, float(meta.get(f"{arch}.rope.freq_base", 10000.0)))
    factor = float(divisors.max())
    for context, low, high in LLAMA3_SETTINGS:
        expected = theta / llama3(theta, RopeScaling("llama3", factor, context, low, high))
        if np.allclose(divisors, expected, rtol=1e-5, atol=0):
            return {"rope_scaling": {"rope_type": "llama3", "factor": factor, "low_freq_factor": low,
                                     "high_freq_factor": high, "original_max_position_embeddings": context}}
    raise QkvError("rope_freqs.weight is not Llama 3.x's llama3 scaling at any of its released settings; "
                   "qkv reads only those")


def llama_settings(hf: dict) -> dict:
    """rope_freqs.weight for a llama model with llama3 scaling (llama.cpp reads no llama3 metadata)."""
    params = hf.get("rope_scaling") or {}
    if params.get("rope_type") != "llama3":
        return {}
    theta = base_frequencies(hf["head_dim"], float(hf["rope_theta"]))
    scaled = llama3(theta, RopeScaling("llama3", params["factor"], params["original_max_position_embeddings"],
                                       params["low_freq_factor"], params["high_freq_factor"]))
    return {"rope_freqs.weight": (theta / scaled).astype(np.float32)}


def renaming(top: dict, block: dict, layers: str, whole: dict | None = None) -> Callable[[str], str | None]:
    """The HF name of a GGUF name, by the (GGUF -> HF) tables: `blk.{i}.{name}` is `{layers}{i}.{block[name]}`;
    `whole`: block tensors named with their kind whose HF name is not `<module>.<kind>` (DeepSeek-V3's
    `exp_probs_b.bias` is `mlp.gate.e_score_correction_bias`)."""
    def name(gguf_name: str) -> str | None:
        base, _, kind = gguf_name.rpartition(".")  # kind: weight or bias
        if base in top:
            return f"{top[base]}.{kind}"
        blk, _, rest = gguf_name.partition(".")
        index, _, rest = rest.partition(".")
        if whole and blk == "blk" and rest in whole:
            return f"{layers}{index}.{whole[rest]}"
        parts = base.split(".")
        if len(parts) == 3 and parts[0] == "blk" and parts[2] in block:
            return f"{layers}{parts[1]}.{block[parts[2]]}.{kind}"
        return None
    return name


llama_name = renaming(LLAMA_TOP, LLAMA_BLOCK, "model.layers.")


def rotary_heads(hf_name: str, hf: dict) -> int | None:
    """The heads whose rows llama.cpp permuted in this tensor: Q's, K's, or None."""
    if hf_name.endswith("self_attn.q_proj.weight"):
        return hf["num_attention_heads"]
    if hf_name.endswith("self_attn.k_proj.weight"):
        return hf["num_key_value_heads"]
    return None


def unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    """ggml's interleaved rotary rows (per head: pairs (2i, 2i + 1)) -> HF's halves (i, i + Dh/2)."""
    return w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def permute(w: np.ndarray, heads: int) -> np.ndarray:
    """HF's halves -> ggml's interleaved rows: llama.cpp's converter's permutation (the inverse of unpermute)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama_to_hf(hf_name: str, w: np.ndarray, hf: dict) -> np.ndarray:
    heads = rotary_heads(hf_name, hf)
    return unpermute(w, heads) if heads else w


def inverse(top: dict, block: dict, layers: str) -> Callable[[str], str]:
    """The GGUF name of an HF name, from the (GGUF -> HF) tables."""
    def name(hf_name: str) -> str:
        base, _, kind = hf_name.rpartition(".")
        for gguf_base, hf_base in top.items():
            if base == hf_base:
                return f"{gguf_base}.{kind}"
        layer, _, rest = base.removeprefix(layers).partition(".")
        for gguf_base, hf_base in block.items():
            if rest == hf_base:
                return f"blk.{layer}.{gguf_base}.{kind}"
        raise QkvError(f"tensor {hf_name!r} has no GGUF name")
    return name


def llama_from_hf(hf_name: str, w: np.ndarray, hf: dict) -> np.ndarray:
    heads = rotary_heads(hf_name, hf)
    return permute(w, heads) if heads else w


def llama_metadata(hf: dict) -> dict:
    scaling = hf.get("rope_scaling") or {}
    extra = {}
    if scaling.get("rope_type") in ("linear", "yarn"):
        extra = {"rope.scaling.type": scaling["rope_type"], "rope.scaling.factor": float(scaling["factor"])}
    if scaling.get("rope_type") == "yarn":
        extra["rope.scaling.original_context_length"] = scaling["original_max_position_embeddings"]
    return {**extra, "context_length": hf["max_position_embeddings"], "embedding_length": hf["hidden_size"],
            "block_count": hf["num_hidden_layers"], "feed_forward_length": hf["intermediate_size"],
            "attention.head_count": hf["num_attention_heads"], "attention.head_count_kv": hf["num_key_value_heads"],
            "rope.dimension_count": hf["head_dim"], "rope.freq_base": float(hf["rope_theta"]),
            "attention.layer_norm_rms_epsilon": float(hf["rms_norm_eps"]), "vocab_size": hf["vocab_size"],
            **experts_metadata(hf)}


GGUF_ARCHS.register("llama")(GgufArch(  # (Mixtral too: a llama file with experts)
    hf_config=llama_config, hf_name=renaming(LLAMA_TOP, MIXTRAL_BLOCK, "model.layers."), to_hf=llama_to_hf,
    gguf_name=inverse(LLAMA_TOP, MIXTRAL_BLOCK, "model.layers."), from_hf=llama_from_hf, metadata=llama_metadata,
    settings=("rope_freqs.weight",), write_settings=llama_settings))


def qwen2_config(meta: dict, shapes: dict) -> dict:
    return llama_config(meta, shapes, "qwen2")


# Qwen2 in llama.cpp: LLaMA's tensor names (with Q/K/V biases) and no row permutation (ggml's NEOX rope is
# HF's rotate-half layout already). qkv writes no Qwen2 model (no metadata), but names its adapters' tensors.
GGUF_ARCHS.register("qwen2")(GgufArch(hf_config=qwen2_config, hf_name=llama_name, to_hf=lambda name, w, hf: w,
                                      gguf_name=inverse(LLAMA_TOP, LLAMA_BLOCK, "model.layers."),
                                      from_hf=lambda name, w, hf: w))


GPT2_BLOCK = {"attn_norm": "ln_1", "attn_qkv": "attn.c_attn", "attn_output": "attn.c_proj", "ffn_norm": "ln_2",
              "ffn_up": "mlp.c_fc", "ffn_down": "mlp.c_proj"}
GPT2_TOP = {"token_embd": "transformer.wte", "position_embd": "transformer.wpe", "output_norm": "transformer.ln_f",
            "output": "lm_head"}
GPT2_CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")


def gpt2_config(meta: dict, shapes: dict) -> dict:
    arch = "gpt2"
    return {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "vocab_size": shapes["token_embd.weight"][0],
            "n_embd": int(need(meta, f"{arch}.embedding_length")), "n_layer": int(need(meta, f"{arch}.block_count")),
            "n_head": int(need(meta, f"{arch}.attention.head_count")),
            "n_inner": int(need(meta, f"{arch}.feed_forward_length")),
            "n_positions": int(need(meta, f"{arch}.context_length")),
            "layer_norm_epsilon": float(need(meta, f"{arch}.attention.layer_norm_epsilon")),
            "activation_function": "gelu_new", "tie_word_embeddings": "output.weight" not in shapes}


gpt2_name = renaming(GPT2_TOP, GPT2_BLOCK, "transformer.h.")


def gpt2_to_hf(hf_name: str, w: np.ndarray, hf: dict) -> np.ndarray:
    """GPT-2's Conv1D keeps its weights (in, out); llama.cpp's converter stores them (out, in)."""
    return np.ascontiguousarray(w.T) if hf_name.endswith(GPT2_CONV1D) else w


def gpt2_metadata(hf: dict) -> dict:
    return {"context_length": hf["n_positions"], "embedding_length": hf["n_embd"], "block_count": hf["n_layer"],
            "feed_forward_length": hf.get("n_inner") or 4 * hf["n_embd"], "attention.head_count": hf["n_head"],
            "attention.layer_norm_epsilon": float(hf["layer_norm_epsilon"])}


GGUF_ARCHS.register("gpt2")(GgufArch(
    hf_config=gpt2_config, hf_name=gpt2_name, to_hf=gpt2_to_hf,
    gguf_name=inverse(GPT2_TOP, GPT2_BLOCK, "transformer.h."), from_hf=gpt2_to_hf, metadata=gpt2_metadata))


# Qwen3 in llama.cpp: LLaMA's names, each head's q/k norm gains, head_dim as attention.key_length, NEOX rope (no
# row permutation)
QWEN3_BLOCK = {**LLAMA_BLOCK, "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}


def qwen3_config(meta: dict, shapes: dict) -> dict:
    hf = llama_config(meta, shapes, "qwen3")
    return {**hf, "head_dim": int(meta.get("qwen3.attention.key_length", hf["head_dim"]))}


def qwen3_metadata(hf: dict) -> dict:
    return {**llama_metadata(hf), "attention.key_length": hf["head_dim"], "attention.value_length": hf["head_dim"]}


GGUF_ARCHS.register("qwen3")(GgufArch(
    hf_config=qwen3_config, hf_name=renaming(LLAMA_TOP, QWEN3_BLOCK, "model.layers."), to_hf=lambda name, w, hf: w,
    gguf_name=inverse(LLAMA_TOP, QWEN3_BLOCK, "model.layers."), from_hf=lambda name, w, hf: w, metadata=qwen3_metadata))
