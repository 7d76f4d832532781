"""The mixture-of-experts architectures in llama.cpp's GGUF layout (convert_hf_to_gguf.py), read and written:
qwen3moe and olmoe (Mixtral is the llama architecture with `llama.expert_count`: qkv.formats.gguf.archs).

Each MoE layer holds its router as `ffn_gate_inp` (E, D) and its experts stacked, `ffn_gate_exps` / `ffn_up_exps`
(E, F, D) and `ffn_down_exps` (E, D, F); qkv.formats.hf.moe splits them into each expert's matrices on reading and
stacks them on writing. Both use NEOX rope (HF's rotate-half layout: no row permutation).

qwen3moe: Qwen3's attention (q/k norm per head, head_dim as attention.key_length), experts
expert_feed_forward_length wide; llama.cpp renormalises the gates (its graph's norm_w is fixed true), so a file is
read with norm_topk_prob and only such a model is written. Every layer routes (llama.cpp has no dense layer for it).
olmoe: q and k normalised over all heads (attention gains n_embd wide: llama.cpp's olmoe has no GQA), gates not
renormalised.
"""
from __future__ import annotations

from qkv.errors import QkvError
from qkv.formats.gguf.archs import (GGUF_ARCHS, LLAMA_BLOCK, LLAMA_TOP, MOE_BLOCK, GgufArch, inverse, llama_config,
                                    llama_metadata, need, renaming)

MOE_LAYER = {**LLAMA_BLOCK, "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
             **{gguf: f"mlp.{hf}" for gguf, hf in MOE_BLOCK.items()}}


def same(name: str, w, hf: dict):
    return w


def qwen3moe_config(meta: dict, shapes: dict) -> dict:
    hf = llama_config(meta, shapes, "qwen3moe")
    if not hf.get("num_local_experts"):
        raise QkvError("qwen3moe.expert_count is missing or 0: a Qwen3-MoE file needs its experts")
    return {**hf, "head_dim": int(meta.get("qwen3moe.attention.key_length", hf["head_dim"])),
            "moe_intermediate_size": int(need(meta, "qwen3moe.expert_feed_forward_length")),
            "norm_topk_prob": True, "mlp_only_layers": [], "decoder_sparse_step": 1}


def qwen3moe_metadata(hf: dict) -> dict:
    if not hf["norm_topk_prob"] or hf["mlp_only_layers"]:
        raise QkvError("llama.cpp's qwen3moe renormalises the gates and routes every layer: a Qwen3-MoE model with "
                       "norm_topk_prob=false or dense layers has no GGUF form")
    return {**llama_metadata(hf), "attention.key_length": hf["head_dim"], "attention.value_length": hf["head_dim"],
            "expert_feed_forward_length": hf["moe_intermediate_size"]}


def olmoe_config(meta: dict, shapes: dict) -> dict:
    hf = llama_config(meta, shapes, "olmoe")
    if not hf.get("num_local_experts"):
        raise QkvError("olmoe.expert_count is missing or 0: an OLMoE file needs its experts")
    return {**hf, "norm_topk_prob": False}


def olmoe_metadata(hf: dict) -> dict:
    if hf["num_key_value_heads"] != hf["num_attention_heads"]:
        raise QkvError("llama.cpp's olmoe has no grouped K/V heads (its k norm is n_embd wide): an OLMoE model with "
                       f"{hf['num_key_value_heads']} of {hf['num_attention_heads']} K/V heads has no GGUF form")
    return llama_metadata(hf)


for _name, _config, _metadata in (("qwen3moe", qwen3moe_config, qwen3moe_metadata),
                                  ("olmoe", olmoe_config, olmoe_metadata)):
    GGUF_ARCHS.register(_name)(GgufArch(
        hf_config=_config, hf_name=renaming(LLAMA_TOP, MOE_LAYER, "model.layers."), to_hf=same,
        gguf_name=inverse(LLAMA_TOP, MOE_LAYER, "model.layers."), from_hf=same, metadata=_metadata))
