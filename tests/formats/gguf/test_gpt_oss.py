"""gpt-oss as llama.cpp's converter lays it out in GGUF (architecture gpt-oss): transformers' interleaved gate_up
split into ffn_gate_exps / ffn_up_exps with their biases, the router with its bias, each head's sink, layers
alternating sliding and global. Written here with the `gguf` package from a tiny random transformers model (F32
experts: the released files' MXFP4 the `gguf` package dequantizes). The oracles: the HF model's logits (qkv
reading the file), and llama.cpp on the same file, with the RoPE llama.cpp and transformers share (no YaRN:
llama.cpp rounds YaRN's ramp, which gpt-oss does not)."""
import numpy as np
import torch

import qkv
from tests.formats.gguf import add_byte_level, finish, gguf, llama_cpp, small_tokenizer, transformers
from tests.formats.hf import perturbed

BLOCK = {"input_layernorm": "attn_norm", "post_attention_layernorm": "post_attention_norm",
         "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
         "self_attn.o_proj": "attn_output", "mlp.router": "ffn_gate_inp"}
TOP = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
       "lm_head.weight": "output.weight"}
E, F, D = 4, 24, 32


def model():
    torch.manual_seed(0)
    m = transformers.GptOssForCausalLM(transformers.GptOssConfig(
        vocab_size=len(small_tokenizer()[0]), hidden_size=D, intermediate_size=F, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=E, num_experts_per_tok=2,
        sliding_window=5, max_position_embeddings=128, rms_norm_eps=1e-5, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, bos_token_id=None, eos_token_id=None,
        pad_token_id=None))
    m = perturbed(m)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name.endswith(("sinks", "_bias", "proj.bias")) or "experts" in name:
                p.normal_(0.0, 0.5)
            if name.endswith("router.weight"):
                p.normal_(0.0, 1.0)
    return m.eval()


def write(path, m):
    writer = gguf.GGUFWriter(str(path), "gpt-oss")
    u32, f32 = gguf.GGUFValueType.UINT32, gguf.GGUFValueType.FLOAT32
    for key, (value, kind) in {"context_length": (128, u32), "embedding_length": (D, u32), "block_count": (2, u32),
                               "feed_forward_length": (F, u32), "expert_feed_forward_length": (F, u32),
                               "attention.head_count": (4, u32), "attention.head_count_kv": (2, u32),
                               "attention.key_length": (8, u32), "attention.value_length": (8, u32),
                               "attention.layer_norm_rms_epsilon": (1e-5, f32), "rope.freq_base": (10000.0, f32),
                               "expert_count": (E, u32), "expert_used_count": (2, u32),
                               "attention.sliding_window": (5, u32)}.items():
        writer.add_key_value(f"gpt-oss.{key}", value, kind)
    add_byte_level(writer)
    for name, t in m.state_dict().items():
        w = t.detach().float().numpy()
        if name in TOP:
            writer.add_tensor(TOP[name], w)
            continue
        _, _, layer, *rest = name.split(".")
        rest = ".".join(rest)
        if rest == "self_attn.sinks":
            writer.add_tensor(f"blk.{layer}.attn_sinks.weight", w)
        elif rest == "mlp.experts.gate_up_proj":  # (E, D, 2F) -> gate, up (E, F, D)
            writer.add_tensor(f"blk.{layer}.ffn_gate_exps.weight", np.ascontiguousarray(w[..., 0::2].transpose(0, 2, 1)))
            writer.add_tensor(f"blk.{layer}.ffn_up_exps.weight", np.ascontiguousarray(w[..., 1::2].transpose(0, 2, 1)))
        elif rest == "mlp.experts.gate_up_proj_bias":
            writer.add_tensor(f"blk.{layer}.ffn_gate_exps.bias", np.ascontiguousarray(w[..., 0::2]))
            writer.add_tensor(f"blk.{layer}.ffn_up_exps.bias", np.ascontiguousarray(w[..., 1::2]))
        elif rest == "mlp.experts.down_proj":  # (E, F, D) -> (E, D, F)
            writer.add_tensor(f"blk.{layer}.ffn_down_exps.weight", np.ascontiguousarray(w.transpose(0, 2, 1)))
        elif rest == "mlp.experts.down_proj_bias":
            writer.add_tensor(f"blk.{layer}.ffn_down_exps.bias", w)
        else:
            module, _, kind = rest.rpartition(".")
            writer.add_tensor(f"blk.{layer}.{BLOCK[module]}.{kind}", w)
    return finish(writer, path)


def test_qkv_reads_the_hf_models_logits_and_llama_cpp_agrees(tmp_path):
    m = model()
    path = write(tmp_path / "oss.gguf", m)
    run = qkv.load(path)
    cfg = run.config.model
    assert cfg.attn_sinks and cfg.layer_types == ("sliding", "global") and cfg.moe_router_bias
    llama_cpp.agrees_with_hf_model(path, m, torch.randint(3, 250, (1, 23)))  # longer than the window of 5
