"""DeepSeek-V2 and -V3 as llama.cpp's converter lays them out in GGUF (architecture deepseek2): W_UK and W_UV split
into attn_k_b (each head's W_UK transposed) and attn_v_b for llama.cpp's absorbed decoding, or one legacy attn_kv_b;
experts stacked; V3's choosing bias as exp_probs_b.bias; RoPE in DeepSeek's interleaved pairs. Written here with
the `gguf` package from tiny random transformers models. The oracles: the HF model's own logits (qkv reading the
file), and llama.cpp reading the same file (logits within 1e-4 of the largest, F32)."""
import numpy as np
import pytest
import torch

import qkv
from tests.formats.gguf import add_byte_level, finish, gguf, llama_cpp, small_tokenizer, transformers
from tests.formats.hf import perturbed

TOP = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
       "lm_head.weight": "output.weight"}
BLOCK = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_a_proj": "attn_q_a",
         "self_attn.q_a_layernorm": "attn_q_a_norm", "self_attn.q_b_proj": "attn_q_b", "self_attn.q_proj": "attn_q",
         "self_attn.kv_a_proj_with_mqa": "attn_kv_a_mqa", "self_attn.kv_a_layernorm": "attn_kv_a_norm",
         "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
         "mlp.down_proj": "ffn_down", "mlp.gate": "ffn_gate_inp", "mlp.shared_experts.gate_proj": "ffn_gate_shexp",
         "mlp.shared_experts.up_proj": "ffn_up_shexp", "mlp.shared_experts.down_proj": "ffn_down_shexp"}
H, NOPE, ROPE, V_DIM, RANK, Q_RANK, EXPERTS = 4, 8, 4, 6, 16, 12, 8


def model(v3: bool, q_rank=Q_RANK):
    common = dict(vocab_size=len(small_tokenizer()[0]), hidden_size=32, intermediate_size=48, num_attention_heads=H,
                  num_key_value_heads=H, num_hidden_layers=3, max_position_embeddings=128, moe_intermediate_size=20,
                  n_routed_experts=EXPERTS, n_shared_experts=1, num_experts_per_tok=2, kv_lora_rank=RANK,
                  q_lora_rank=q_rank, qk_nope_head_dim=NOPE, qk_rope_head_dim=ROPE, v_head_dim=V_DIM,
                  first_k_dense_replace=1, routed_scaling_factor=2.5, tie_word_embeddings=False, rms_norm_eps=1e-6,
                  bos_token_id=None, eos_token_id=None, pad_token_id=None)
    torch.manual_seed(0)
    m = (transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**common, n_group=4, topk_group=2)) if v3 else
         transformers.DeepseekV2ForCausalLM(transformers.DeepseekV2Config(**common, topk_method="greedy")))
    m = perturbed(m)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.normal_(0.0, 1.0)
            if "self_attn" in name and "norm" not in name:
                p.normal_(0.0, 0.3)
        for name, b in m.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.rand_like(b) * 0.1)
    return m.eval()


def write(path, m, v3: bool, split: bool = True):
    """As convert_hf_to_gguf.py's DeepseekV2Model writes it."""
    cfg = m.config
    writer = gguf.GGUFWriter(str(path), "deepseek2")
    u32, f32 = gguf.GGUFValueType.UINT32, gguf.GGUFValueType.FLOAT32
    meta = {"context_length": (128, u32), "embedding_length": (32, u32), "block_count": (3, u32),
            "feed_forward_length": (48, u32), "attention.head_count": (H, u32), "attention.head_count_kv": (1, u32),
            "attention.layer_norm_rms_epsilon": (1e-6, f32), "rope.freq_base": (10000.0, f32),
            "leading_dense_block_count": (1, u32), "attention.kv_lora_rank": (RANK, u32),
            "attention.key_length": (RANK + ROPE, u32), "attention.value_length": (RANK, u32),
            "attention.key_length_mla": (NOPE + ROPE, u32), "attention.value_length_mla": (V_DIM, u32),
            "expert_feed_forward_length": (20, u32), "expert_count": (EXPERTS, u32), "expert_used_count": (2, u32),
            "expert_shared_count": (1, u32), "expert_weights_scale": (2.5, f32), "rope.dimension_count": (ROPE, u32)}
    if cfg.q_lora_rank:
        meta["attention.q_lora_rank"] = (cfg.q_lora_rank, u32)
    if not split:  # a legacy file: the per-head key and value lengths, no MLA view of them
        meta.update({"attention.key_length": (NOPE + ROPE, u32), "attention.value_length": (V_DIM, u32),
                     "attention.head_count_kv": (H, u32)})
        del meta["attention.key_length_mla"], meta["attention.value_length_mla"]
    if v3:
        meta.update({"expert_gating_func": (2, u32), "expert_group_count": (4, u32), "expert_group_used_count": (2, u32)})
        writer.add_key_value("deepseek2.expert_weights_norm", True, gguf.GGUFValueType.BOOL)
    for key, (value, kind) in meta.items():
        writer.add_key_value(f"deepseek2.{key}", value, kind)
    add_byte_level(writer)
    state = {name: t.detach().float().numpy() for name, t in m.state_dict().items()}
    for i in range(3):
        prefix = f"model.layers.{i}.mlp.experts."
        if f"{prefix}gate_up_proj" in state:  # transformers 5's stacked experts -> llama.cpp's three
            gate_up = state.pop(f"{prefix}gate_up_proj")
            writer.add_tensor(f"blk.{i}.ffn_gate_exps.weight", np.ascontiguousarray(gate_up[:, :20]))
            writer.add_tensor(f"blk.{i}.ffn_up_exps.weight", np.ascontiguousarray(gate_up[:, 20:]))
            writer.add_tensor(f"blk.{i}.ffn_down_exps.weight", state.pop(f"{prefix}down_proj"))
        kv_b = state.pop(f"model.layers.{i}.self_attn.kv_b_proj.weight").reshape(H, NOPE + V_DIM, RANK)
        if split:
            writer.add_tensor(f"blk.{i}.attn_k_b.weight", np.ascontiguousarray(kv_b[:, :NOPE].transpose(0, 2, 1)))
            writer.add_tensor(f"blk.{i}.attn_v_b.weight", np.ascontiguousarray(kv_b[:, NOPE:]))
        else:
            writer.add_tensor(f"blk.{i}.attn_kv_b.weight", kv_b.reshape(-1, RANK))
        bias = state.pop(f"model.layers.{i}.mlp.gate.e_score_correction_bias", None)
        if bias is not None:
            writer.add_tensor(f"blk.{i}.exp_probs_b.bias", bias)
    for name, w in state.items():
        if name in TOP:
            writer.add_tensor(TOP[name], w)
            continue
        _, _, layer, *rest = name.split(".")
        writer.add_tensor(f"blk.{layer}.{BLOCK['.'.join(rest[:-1])]}.{rest[-1]}", w)
    return finish(writer, path)


@pytest.mark.parametrize("v3, split", [(True, True), (False, True), (False, False)])
def test_qkv_reads_the_hf_models_logits_and_llama_cpp_agrees(v3, split, tmp_path):
    m = model(v3)
    path = write(tmp_path / "ds.gguf", m, v3, split)
    run = qkv.load(path)
    assert run.config.model.moe_scoring == ("sigmoid" if v3 else "softmax")
    llama_cpp.agrees_with_hf_model(path, m, torch.randint(3, 250, (1, 23)))


def test_a_v2_lite_without_a_query_latent(tmp_path):
    m = model(False, q_rank=None)
    run = qkv.load(write(tmp_path / "lite.gguf", m, False))
    assert run.config.model.mla_q_rank == 0
    ids = torch.randint(3, 250, (1, 17))
    with torch.no_grad():
        assert (run.model(ids) - m(ids).logits).abs().max() < 1e-4 * m(ids).logits.abs().max()
