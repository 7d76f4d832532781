"""Parameter counts (SPEC F1): the formulas of qkv.analysis.params equal the built models' parameters
exactly, for every family qkv.build_model can build and every variant axis that changes the count."""
from dataclasses import replace

import pytest

import qkv
from qkv import presets
from qkv.analysis import params
from qkv.config import ModelConfig
from qkv.errors import QkvError
from qkv.models.build import ARCHITECTURES, check_model
from qkv.nn import registries

BASE = dict(vocab_size=37, d_model=16, n_heads=4, n_layers=2, d_ff=24, max_seq_len=20)
VARIANTS = [{}, {"n_kv_heads": 2}, {"n_kv_heads": 1}, {"ffn": "glu", "activation": "silu"},
            {"moe_experts": 3, "moe_top_k": 2}, {"moe_experts": 2, "moe_top_k": 1, "ffn": "glu"},
            {"moe_experts": 4, "moe_top_k": 2, "ffn": "glu", "moe_d_ff": 8, "moe_shared_experts": 2,
             "moe_choice_bias": True},  # DeepSeek's kind (the bias a buffer, no parameter)
            {"moe_experts": 4, "moe_top_k": 2, "moe_dense_layers": (0,)},
            {"moe_experts": 4, "moe_top_k": 2, "ffn": "glu_clamped", "activation": "silu", "moe_router_bias": True,
             "attn_sinks": True, "positional": "rope", "n_kv_heads": 2},  # gpt-oss's kind
            {"positional": "rope", "head_size": 12, "mla_kv_rank": 16, "mla_q_rank": 8, "mla_rope_dims": 4,
             "mla_v_dims": 10}, {"positional": "rope", "head_size": 12, "mla_kv_rank": 16, "mla_rope_dims": 4}, {"qk_norm": True, "qk_norm_whole": True,
                                                                          "n_kv_heads": 2},
            {"tie_embeddings": False}, {"bias": False}, {"bigram_vocab": 50}, {"norm": "rmsnorm"}, {"embed_norm": True},
            {"type_vocab_size": 2}, {"head": "mlm"}, {"head": "mlm", "tie_embeddings": False},
            {"head": "classifier", "n_classes": 3}, {"n_encoder_layers": 3, "n_decoder_layers": 1}]
VARIANTS += [{"norm_placement": p} for p in registries.get("norm_placement").names()]
VARIANTS += [{"positional": p} for p in registries.get("positional").names()]
ARCHS = ("decoder", "encoder", "encoder-decoder")  # a family not built yet is skipped, tested when it lands


def built_count(cfg: ModelConfig) -> int:
    return sum(p.numel() for p in qkv.build_model(cfg).parameters())  # shared (tied) tensors once


def shrunk(cfg: ModelConfig) -> ModelConfig:
    """The same structure at a size that builds in milliseconds: 2 layers per stack, 8-wide heads, a small
    vocabulary; the counts are polynomials in these sizes, so the structure is what is checked."""
    width = 8 * cfg.n_heads
    return replace(cfg, vocab_size=min(cfg.vocab_size, 500), d_model=width, d_ff=width * cfg.d_ff // cfg.d_model,
                   n_layers=min(cfg.n_layers, 2), n_encoder_layers=min(cfg.n_encoder_layers, 2),
                   n_decoder_layers=min(cfg.n_decoder_layers, 2), max_seq_len=min(cfg.max_seq_len, 64))


@pytest.mark.parametrize("arch", ARCHS)
def test_counts_equal_built_models(arch):
    if arch not in ARCHITECTURES.names():
        pytest.skip(f"qkv.build_model cannot build arch={arch!r} yet")
    checked = 0
    for variant in VARIANTS:
        cfg = ModelConfig(arch=arch, **BASE, **variant)
        try:
            check_model(cfg)
        except QkvError:
            continue  # a combination this family refuses (e.g. an MLM head on a decoder)
        breakdown = params.breakdown(cfg)
        assert breakdown["total"] == built_count(cfg), (arch, variant, breakdown)
        checked += 1
    assert checked >= 15


@pytest.mark.parametrize("name", presets.PRESETS.names())
def test_presets_equal_built_models(name):
    cfg = shrunk(presets.get(name).model)
    assert params.count(cfg) == built_count(cfg)


def test_gpt3_is_175b():
    """Note 000 LLM §8.1: L=96, d=12288 -> 175B; 12 L d^2 dominates."""
    counts = params.breakdown(presets.get("gpt3-175b").model)
    assert counts["total"] == pytest.approx(175e9, rel=0.005)
    assert counts["attention"] + counts["ffn"] == pytest.approx(12 * 96 * 12288 ** 2, rel=1e-3)
    assert counts["lm_head"] == 0  # tied


def test_components_add_up_and_moe_active():
    cfg = ModelConfig(**BASE, moe_experts=4, moe_top_k=1)
    counts = params.breakdown(cfg)
    parts = {k: v for k, v in counts.items() if k not in ("total", "non_embedding", "active")}
    assert sum(parts.values()) == counts["total"]
    dense = params.dense_ffn(cfg)
    assert counts["total"] - counts["active"] == cfg.n_layers * 3 * dense  # 3 of 4 experts idle per token
    assert counts["non_embedding"] == counts["total"] - counts["embedding"] - counts["positional"]


def test_active_parameters_of_routed_dense_and_shared_layers():
    """Per token: the dense layer whole, k of E experts, the router and the shared experts of each MoE layer."""
    cfg = ModelConfig(**{**BASE, "n_layers": 3}, ffn="glu", moe_experts=6, moe_top_k=2, moe_d_ff=10,
                      moe_shared_experts=1, moe_dense_layers=(0,), bias=False)
    counts = params.breakdown(cfg)
    D, expert = 16, 3 * 16 * 10
    assert counts["ffn"] == 3 * 16 * 24 + 2 * (6 * expert + D * 6 + expert)
    assert counts["total"] - counts["active"] == 2 * 4 * expert
    assert counts["total"] == built_count(cfg)


def test_gqa_shrinks_kv_projections_only():
    mha, mqa = (params.attention(ModelConfig(**BASE, bias=False, n_kv_heads=k)) for k in (0, 1))
    D, Dh = BASE["d_model"], BASE["d_model"] // BASE["n_heads"]
    assert mha == 4 * D * D  # note 000 §2.2.2: W^Q, W^K, W^V, W^O
    assert mha - mqa == 2 * D * (D - Dh)
