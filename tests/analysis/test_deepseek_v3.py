"""`qkv calc` on DeepSeek-V3's published config.json (61 layers, 7,168 wide, 256 routed experts, top 8, one shared,
MLA ranks 1,536 / 512, three dense layers first): the technical report's 671 B parameters in all and 37 B active a
token (its multi-token-prediction module, 14 B more in the released checkpoint, apart), and its KV cache a token
against multi-head and grouped-query attention of the same heads. Read from the config alone: no weight exists."""
import json

import pytest

from qkv.analysis import memory, params
from tests.formats.hf import cli

V3 = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "vocab_size": 129280,
      "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61,
      "num_attention_heads": 128, "num_key_value_heads": 128, "n_shared_experts": 1, "n_routed_experts": 256,
      "routed_scaling_factor": 2.5, "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64,
      "v_head_dim": 128, "qk_nope_head_dim": 128, "topk_method": "noaux_tc", "n_group": 8, "topk_group": 4,
      "num_experts_per_tok": 8, "first_k_dense_replace": 3, "norm_topk_prob": True, "scoring_func": "sigmoid",
      "hidden_act": "silu", "max_position_embeddings": 163840, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
      "num_nextn_predict_layers": 1, "rope_theta": 10000,
      "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                       "original_max_position_embeddings": 4096, "type": "yarn"}}


@pytest.fixture
def v3_dir(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(V3))
    return tmp_path


def test_671b_in_all_and_37b_active(v3_dir):
    from qkv.formats import load_config

    cfg = load_config(v3_dir).model
    counts = params.breakdown(cfg)
    assert counts["total"] == 671_026_404_352  # the report: 671 B
    assert counts["active"] == pytest.approx(37e9, rel=0.02)  # the report: 37 B (37.55 B counted)
    code, out, err = cli("calc", str(v3_dir), "--seq", "4096", "--batch", "1", "--json")
    assert code == 0, err
    assert json.loads(out)["params"]["active"] == counts["active"]


def test_the_latent_cache_a_token_against_mha_and_gqa(v3_dir):
    """576 elements a token a layer (the 512 latent + the 64-wide RoPE key), whatever the 128 heads: 1/57 of MHA
    with V3's 128-wide values and keys (2 x 128 x 128), 1/3.6 of GQA with 8 groups."""
    from dataclasses import replace

    from qkv.formats import load_config

    cfg = load_config(v3_dir).model
    per_token = memory.kv_cache(cfg, batch=1, seq=1, bytes_per_element=1)
    assert per_token == 61 * 576
    plain = replace(cfg, mla_kv_rank=0, mla_q_rank=0, mla_rope_dims=0, mla_v_dims=0, head_size=128)
    assert memory.kv_cache(plain, batch=1, seq=1, bytes_per_element=1) == 61 * 2 * 128 * 128
    assert memory.kv_cache(replace(plain, n_kv_heads=8), batch=1, seq=1, bytes_per_element=1) == 61 * 2 * 8 * 128
