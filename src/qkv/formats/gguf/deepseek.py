"""DeepSeek-V2 and -V3 in llama.cpp's GGUF layout (architecture `deepseek2`, convert_hf_to_gguf.py's DeepseekV2Model),
read as the Hugging Face checkpoint it was converted from (qkv.formats.hf.deepseek then maps that).

Latent attention: attn_q_a / attn_q_a_norm / attn_q_b (or attn_q), attn_kv_a_mqa, attn_kv_a_norm, attn_output, and
W_UK, W_UV either as the HF checkpoint's one attn_kv_b (files converted before 2025) or split for llama.cpp's
absorbed decoding into attn_k_b, each head's W_UK transposed (H, r, d_N), and attn_v_b (H, d_V, r): joined back
here. RoPE stays in DeepSeek's interleaved pairs (llama.cpp's NORM rope, no row permutation), as in the HF files.
MoE: ffn_gate_inp, the stacked ffn_*_exps, the shared experts ffn_*_shexp as one FFN, V3's choosing bias
exp_probs_b.bias; the first leading_dense_block_count layers dense. Routing from the metadata: expert_gating_func
(1 softmax: V2; 2 sigmoid: V3; absent: softmax, as llama.cpp reads old V2 files), expert_weights_norm,
expert_weights_scale, expert_group_count / expert_group_used_count (groups ranked by their two best scores,
llama.cpp's rule, which is V3's); YaRN's mscale_all_dim from rope.scaling.yarn_log_multiplier (0.1 mscale_all_dim,
as the converter writes it). llama.cpp's metadata says one K/V head (its MQA view of the latent): ignored.
"""
from __future__ import annotations

import numpy as np

from qkv.errors import QkvError
from qkv.formats.gguf.archs import GGUF_ARCHS, LLAMA_TOP, GgufArch, need, renaming

BLOCK = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
         "attn_q_a": "self_attn.q_a_proj", "attn_q_a_norm": "self_attn.q_a_layernorm", "attn_q_b": "self_attn.q_b_proj",
         "attn_q": "self_attn.q_proj", "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa",
         "attn_kv_a_norm": "self_attn.kv_a_layernorm", "attn_kv_b": "self_attn.kv_b_proj",
         "attn_k_b": "self_attn.k_b_proj", "attn_v_b": "self_attn.v_b_proj", "attn_output": "self_attn.o_proj",
         "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj", "ffn_gate_inp": "mlp.gate",
         "ffn_gate_exps": "mlp.experts.gate_proj", "ffn_up_exps": "mlp.experts.up_proj",
         "ffn_down_exps": "mlp.experts.down_proj", "ffn_gate_shexp": "mlp.shared_experts.gate_proj",
         "ffn_up_shexp": "mlp.shared_experts.up_proj", "ffn_down_shexp": "mlp.shared_experts.down_proj"}
hf_name = renaming(LLAMA_TOP, BLOCK, "model.layers.", {"exp_probs_b.bias": "mlp.gate.e_score_correction_bias"})


def hf_config(meta: dict, shapes: dict) -> dict:
    arch = "deepseek2"

    def key(name, default=None):
        return meta.get(f"{arch}.{name}", default)

    d_model, n_heads = int(need(meta, f"{arch}.embedding_length")), int(need(meta, f"{arch}.attention.head_count"))
    rope = int(need(meta, f"{arch}.rope.dimension_count"))
    qk = int(key("attention.key_length_mla") or need(meta, f"{arch}.attention.key_length"))
    v_dim = int(key("attention.value_length_mla") or need(meta, f"{arch}.attention.value_length"))
    if not 0 < rope < qk:
        raise QkvError(f"{arch}.rope.dimension_count={rope} must be below the key length {qk} (its nope dims + it)")
    gating = int(key("expert_gating_func", 1))
    if gating not in (1, 2):
        raise QkvError(f"{arch}.expert_gating_func={gating}: qkv reads 1 (softmax) and 2 (sigmoid)")
    v3 = gating == 2
    groups = int(key("expert_group_count", 0) or 0)
    hf = {"model_type": "deepseek_v3" if v3 else "deepseek_v2",
          "architectures": ["DeepseekV3ForCausalLM" if v3 else "DeepseekV2ForCausalLM"],
          "vocab_size": shapes["token_embd.weight"][0], "hidden_size": d_model, "num_attention_heads": n_heads,
          "num_hidden_layers": int(need(meta, f"{arch}.block_count")),
          "intermediate_size": int(need(meta, f"{arch}.feed_forward_length")),
          "moe_intermediate_size": int(need(meta, f"{arch}.expert_feed_forward_length")),
          "n_routed_experts": int(need(meta, f"{arch}.expert_count")),
          "num_experts_per_tok": int(need(meta, f"{arch}.expert_used_count")),
          "n_shared_experts": int(key("expert_shared_count", 0)),
          "first_k_dense_replace": int(key("leading_dense_block_count", 0)),
          "routed_scaling_factor": float(key("expert_weights_scale", 1.0) or 1.0),
          "norm_topk_prob": bool(key("expert_weights_norm", False)),
          "q_lora_rank": int(key("attention.q_lora_rank", 0) or 0) or None,
          "kv_lora_rank": int(need(meta, f"{arch}.attention.kv_lora_rank")),
          "qk_rope_head_dim": rope, "qk_nope_head_dim": qk - rope, "v_head_dim": v_dim,
          "max_position_embeddings": int(key("context_length", 4096)),
          "rms_norm_eps": float(need(meta, f"{arch}.attention.layer_norm_rms_epsilon")),
          "rope_theta": float(key("rope.freq_base", 10000.0)), "hidden_act": "silu",
          "tie_word_embeddings": "output.weight" not in shapes, **rope_scaling(meta, arch)}
    if groups > 1:
        hf.update(n_group=groups, topk_group=int(need(meta, f"{arch}.expert_group_used_count")),
                  topk_method="noaux_tc" if v3 else "group_limited_greedy")
    elif v3:
        hf.update(n_group=1, topk_group=1)
    return hf


def rope_scaling(meta: dict, arch: str) -> dict:
    kind = meta.get(f"{arch}.rope.scaling.type", "none")
    if kind in ("none", None):
        return {}
    if kind != "yarn":
        raise QkvError(f"{arch}.rope.scaling.type={kind!r}: qkv reads DeepSeek's YaRN only")
    log_mul = float(meta.get(f"{arch}.rope.scaling.yarn_log_multiplier", 0.0))
    return {"rope_scaling": {"type": "yarn", "factor": float(need(meta, f"{arch}.rope.scaling.factor")),
                             "original_max_position_embeddings":
                                 int(need(meta, f"{arch}.rope.scaling.original_context_length")),
                             "mscale": log_mul / 0.1, "mscale_all_dim": log_mul / 0.1, "beta_fast": 32,
                             "beta_slow": 1}}  # (one mscale both ways, as V3's config sets them)


def to_hf(name: str, w: np.ndarray, hf: dict) -> np.ndarray:
    return w


GGUF_ARCHS.register("deepseek2")(GgufArch(hf_config=hf_config, hf_name=hf_name, to_hf=to_hf))
