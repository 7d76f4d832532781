"""DeepSeek-V2, V2-Lite and V3 from Hugging Face dirs, each a tiny random model built with transformers' own class:
multi-head latent attention (q through its own latent, or V2-Lite's full projection; interleaved RoPE on the
decoupled key), the first layer dense, the rest MoE with shared experts (V2: softmax, groups ranked by their best
score, unnormalised and scaled; V3: sigmoid scores, a choosing bias, groups by their two best, normalised and
scaled). Logits within 1e-5 of transformers' on right-padded rows, greedy generation token for token (qkv decodes
from the latent cache: r + d_R numbers a token a layer), and the YaRN mscale V3 ships with."""
import re

import pytest
import torch

import qkv
from qkv.analysis import memory

transformers = pytest.importorskip("transformers")

from tests.formats.hf import V, check_decoder, check_greedy, perturbed, save_hf  # noqa: E402

COMMON = dict(vocab_size=V, hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=4,
              num_hidden_layers=3, max_position_embeddings=64, moe_intermediate_size=20, n_routed_experts=8,
              n_shared_experts=1, num_experts_per_tok=2, kv_lora_rank=16, q_lora_rank=12, qk_nope_head_dim=8,
              qk_rope_head_dim=4, v_head_dim=6, first_k_dense_replace=1, routed_scaling_factor=2.5,
              tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=None)


def v3(**extra):
    return transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**{**COMMON, "n_group": 4, "topk_group": 2,
                                                                             **extra}))


def v2(**extra):
    return transformers.DeepseekV2ForCausalLM(transformers.DeepseekV2Config(**{
        **COMMON, "topk_method": "group_limited_greedy", "n_group": 4, "topk_group": 2, **extra}))


MODELS = {
    "v3": v3,
    "v2": v2,
    "v2-lite": lambda: v2(q_lora_rank=None, topk_method="greedy", n_group=None, topk_group=None),
    "v3-yarn": lambda: v3(rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                           "original_max_position_embeddings": 16, "mscale": 1.0,
                                           "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1}),
}


def routed(model):
    """Norm gains perturbed, routers with clear margins, V3's choosing bias drawn (positive, as trained ones are),
    the attention's projections large enough that its scores, and so RoPE's scaling, move the logits."""
    model = perturbed(model)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.normal_(0.0, 1.0)
            if re.search(r"self_attn\.(q_a_proj|q_b_proj|q_proj|kv_a_proj_with_mqa|kv_b_proj)\.weight$", name):
                p.normal_(0.0, 0.5)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.rand_like(b) * 0.1)
    return model


@pytest.mark.parametrize("name", MODELS)
def test_logits_match_transformers(name, tmp_path):
    """Read, and written back as the same version (transformers' logits again)."""
    torch.manual_seed(0)
    check_decoder(routed(MODELS[name]()), tmp_path)


@pytest.mark.parametrize("name", ["v3", "v2-lite"])
def test_greedy_generation_matches_transformers(name, tmp_path):
    torch.manual_seed(1)
    check_greedy(routed(MODELS[name]()), tmp_path)


def test_what_v3_reads_as_and_its_latent_cache(tmp_path):
    torch.manual_seed(0)
    run = qkv.load(save_hf(routed(v3()), tmp_path / "hf"))
    cfg = run.config.model
    assert (cfg.mla_kv_rank, cfg.mla_q_rank, cfg.mla_rope_dims, cfg.mla_v_dims, cfg.head_dim) == (16, 12, 4, 6, 12)
    assert (cfg.moe_scoring, cfg.moe_choice_bias, cfg.moe_groups, cfg.moe_group_top_k, cfg.moe_scale,
            cfg.moe_dense_layers, cfg.moe_shared_experts) == ("sigmoid", True, 4, 2, 2.5, (0,), 1)
    cache = run.model.new_cache(2, 40)
    layer = cache.layers[0]
    assert layer.k.shape == (2, 1, 40, 16 + 4) and layer.v.shape[-1] == 0  # [c ; k^R] a token, nothing else
    held = sum(layer.k.nbytes + layer.v.nbytes for layer in cache.layers)
    assert memory.kv_cache(cfg, batch=2, seq=40, bytes_per_element=4) == held  # qkv calc's figure is what it holds


def test_direct_logit_attribution_adds_up_with_latent_heads(tmp_path):
    """Each head's term through W_O's d_V columns (qkv.nn.mla's z is (B, H, T, d_V)), the FFNs' and the
    embedding's: together with the constant they are the logit."""
    from qkv.interp import direct_logit_attribution

    torch.manual_seed(0)
    run = qkv.load(save_hf(routed(v3()), tmp_path / "hf"))
    found = direct_logit_attribution(run.model.double(), torch.randint(0, V, (1, 9)))
    heads = [name for name, _ in found["components"] if ".attn.head" in name]
    assert len(heads) == 3 * 4
    assert sum(term for _, term in found["components"]) + found["constant"] == pytest.approx(found["logit"], abs=1e-9)
