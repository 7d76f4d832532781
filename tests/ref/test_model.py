"""Whole models of every family, reference engine vs the torch engine in float64 from the same random
weights: logits, loss, every parameter gradient, and 10 AdamW steps (per-step losses and the final
parameters)."""
import numpy as np
import pytest

from qkv.config import ModelConfig
from qkv.formats.params import compare_engines, randomize
from qkv.models import build_model
from qkv.errors import QkvError
from qkv.ref import UNSUPPORTED, loss_and_grads
from qkv.ref.model import ARCHITECTURES

TINY = dict(vocab_size=11, d_model=8, n_heads=2, n_layers=2, d_ff=12, max_seq_len=8)
VARIANTS = {  # together: every positional, norm, placement, activation, FFN and K/V head layout
    "gpt2": dict(),
    "llama": dict(norm="rmsnorm", ffn="glu", activation="silu", positional="rope", tie_embeddings=False,
                  bias=False, n_kv_heads=1),
    "post-ln-sinusoidal-relu": dict(norm_placement="post", positional="sinusoidal", activation="relu"),
    "alibi-naive-gelu_tanh": dict(positional="alibi", attention="naive", activation="gelu_tanh"),
    "nopos-leaky_relu-post-rms": dict(positional="none", activation="leaky_relu", norm="rmsnorm",
                                      norm_placement="post"),
    "relu6-geglu-gqa": dict(activation="relu6", ffn="glu", n_heads=4, n_kv_heads=2, tie_embeddings=False),
    "sandwich-t5": dict(norm_placement="sandwich", positional="t5"),
    "shaw-rms": dict(positional="shaw", norm="rmsnorm", max_distance=2),
    "xl-gelu-glu": dict(positional="xl", ffn="glu", activation="gelu"),
    "qk_norm-rope-relu2": dict(qk_norm=True, positional="rope", activation="relu2", norm="rmsnorm"),
    "qk_norm-alibi-mqa": dict(qk_norm=True, positional="alibi", n_heads=4, n_kv_heads=1),
    "softcap-rope": dict(logit_softcap=0.05, positional="rope"),  # a cap that bends these logits
    "bigram-rope": dict(bigram_vocab=7, positional="rope"),  # 7 rows for 121 pairs: shared rows, the none row
    # the per-layer plan (qkv.plan): Gemma's shape (sliding / global / nope layers, a local base, head_dim not
    # D / H, its own score scale, soft-capped scores, embeddings times sqrt(D)) and a scaled RoPE each
    "gemma-plan": dict(positional="rope", norm="rmsnorm", norm_placement="sandwich", ffn="glu",
                       activation="gelu_tanh", qk_norm=True, embed_scale=True, head_size=6, query_scale=5.0,
                       attn_softcap=0.5, n_layers=3, layer_types=("sliding", "global", "nope"), sliding_window=3,
                       rope_local_theta=100.0, n_heads=2, n_kv_heads=1),
    "yarn-rope": dict(positional="rope", rope_scaling="yarn", rope_factor=4.0, rope_original_context=4,
                      rope_theta=100.0),
    "llama3-rope": dict(positional="rope", rope_scaling="llama3", rope_factor=8.0, rope_original_context=16,
                        rope_theta=10000.0),
    "partial-rope": dict(positional="rope", rope_dims=2, rope_theta=100.0),  # 2 of each head's dimensions turned
    "longrope": dict(positional="rope", rope_scaling="longrope", rope_original_context=3, rope_theta=100.0,
                     rope_dims=4, rope_long_factors=(1.5, 3.0), rope_short_factors=(1.0, 1.2),
                     rope_attention_factor=1.1),  # past 3 positions: the long set
}
# the torch engine's kernels at model level (padded, so the masks combine with each pattern); seq 18 reaches
# the random kernel's first random distance (w + 1 + 12)
KERNEL_VARIANTS = {
    "local": (dict(attention="local", window=1), 5),
    "dilated": (dict(attention="dilated", window=2), 5),
    "random": (dict(attention="random", window=1, max_seq_len=18), 18),
    "linear-explicit-t5": (dict(attention="linear", positional="t5"), 5),
    "flash-shaw": (dict(attention="flash", positional="shaw", max_distance=2), 5),
    "seq2seq-local-self-full-cross": (dict(arch="encoder-decoder", attention="local", window=1), 5),
}


def assert_engines_agree(report):
    assert report["grad_names_equal"]
    assert report["logits"] < 1e-12 and report["loss"] < 1e-12 and report["grads"] < 1e-12, report
    # Adam divides by sqrt(v): a gradient that is exactly 0 in theory (k_proj.bias) but 1e-17 in torch
    # moves by up to lr * 1e-17 / (1e-17 + eps) ~ 1e-11, so parameters agree to 1e-9, not 1e-15
    assert report["step_losses"] < 1e-10 and report["params_after_steps"] < 1e-9, report


@pytest.mark.parametrize("padded", [False, True], ids=["dense", "left-padded"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_decoder_matches_torch_engine(variant, padded):
    assert_engines_agree(compare_engines(ModelConfig(**{**TINY, **VARIANTS[variant]}), seed=3, padded=padded))


@pytest.mark.parametrize("kernel", list(KERNEL_VARIANTS))
def test_kernels_match_torch_engine_in_a_model(kernel):
    overrides, seq = KERNEL_VARIANTS[kernel]
    assert_engines_agree(compare_engines(ModelConfig(**{**TINY, **overrides}), seed=3, padded=True, seq=seq))


MOE_VARIANTS = {"top2of3": dict(moe_experts=3, moe_top_k=2, ffn="glu", activation="silu"),
                "capacity": dict(moe_experts=2, moe_top_k=2, moe_capacity_factor=0.6),
                # OLMoE's unnormalised gates; DeepSeek-V2 and -V3 routing with a shared expert, the first layer dense
                "olmoe": dict(moe_experts=4, moe_top_k=2, ffn="glu", activation="silu", moe_norm_topk=False),
                "deepseek_v2": dict(moe_experts=4, moe_top_k=2, ffn="glu", activation="silu", moe_norm_topk=False,
                                    moe_scale=2.5, moe_groups=2, moe_group_top_k=1, moe_shared_experts=1,
                                    moe_d_ff=6, moe_dense_layers=(0,)),
                "deepseek_v3": dict(moe_experts=4, moe_top_k=2, ffn="glu", activation="silu", moe_scoring="sigmoid",
                                    moe_scale=2.5, moe_groups=2, moe_group_top_k=1, moe_choice_bias=True,
                                    moe_shared_experts=1, moe_d_ff=6, moe_dense_layers=(0,)),
                # DeepSeek-V3's whole layer: latent attention (q through its latent, the scores' scale set) over
                # V3's routing
                "deepseek_v3_mla": dict(moe_experts=4, moe_top_k=2, ffn="glu", activation="silu", moe_scoring="sigmoid",
                                        moe_scale=2.5, moe_groups=2, moe_group_top_k=1, moe_choice_bias=True,
                                        moe_shared_experts=1, moe_dense_layers=(0,), positional="rope", norm="rmsnorm",
                                        bias=False, head_size=6, mla_kv_rank=5, mla_q_rank=4, mla_rope_dims=4,
                                        mla_v_dims=3, query_scale=10.0),
                # gpt-oss's layer: attention sinks, alternating windows, YaRN unrounded, a router bias, the
                # clamped SwiGLU
                "gpt_oss": dict(moe_experts=4, moe_top_k=2, ffn="glu_clamped", activation="silu", moe_router_bias=True,
                                attn_sinks=True, positional="rope", layer_types=("sliding", "global"), sliding_window=3,
                                n_kv_heads=1, rope_scaling="yarn", rope_factor=4.0, rope_original_context=4,
                                rope_yarn_truncate=False),
                "mla_full_q": dict(moe_experts=2, moe_top_k=2, positional="rope", norm="rmsnorm", bias=False,
                                   head_size=6, mla_kv_rank=5, mla_rope_dims=2)}


MOE_DRAWS = {"olmoe": (2, 8), "deepseek_v2": (0, 8), "deepseek_v3": (0, 8), "deepseek_v3_mla": (2, 8), "gpt_oss": (0, 8)}


@pytest.mark.parametrize("moe", list(MOE_VARIANTS))
def test_moe_with_its_balance_loss_matches_torch_engine(moe):
    """Router and expert names, the gates, capacity dropping and the aux loss E sum_e f_e P_e (weight 0.1),
    through 10 steps."""
    seed, seq = MOE_DRAWS.get(moe, (0, 5))  # draws that leave no expert idle for 10 steps (the test below)
    assert_engines_agree(compare_engines(ModelConfig(**TINY, **MOE_VARIANTS[moe]), seed=seed, seq=seq, padded=True,
                                         aux_weight=0.1))


def test_an_expert_without_tokens_is_where_the_engines_part():
    """Known mismatch (docs/DEVIATIONS.md): torch leaves .grad None on an expert no token was routed to, so
    torch.optim skips it (no decay, no moment update); the reference engine gives it an exact zero gradient
    and AdamW decays it. Same loss and gradients, different steps."""
    cfg = ModelConfig(**{**TINY, "max_seq_len": 40}, moe_experts=3, moe_top_k=2, ffn="glu", activation="silu")
    report = compare_engines(cfg, seed=3, padded=True, aux_weight=0.1)  # this draw leaves one expert idle
    assert not report["grad_names_equal"] and report["grads"] < 1e-12 and report["loss"] < 1e-12
    assert report["params_after_steps"] > 1e-3


def test_tied_gradient_is_the_sum_of_both_uses():
    """With W_out = W_E, d loss / d W_E = (embedding's scatter-add) + (output layer's H^T dL): the same
    numbers as an untied model whose two matrices happen to be equal, summed."""
    cfg = ModelConfig(**TINY)
    params = randomize(build_model(cfg).double(), 0)
    untied = {**params, "lm_head.weight": params["tok_emb.weight"].copy()}
    ids, targets = np.random.default_rng(0).integers(0, 11, (2, 2, 5))
    _, tied, _ = loss_and_grads(params, cfg, ids, targets)
    _, separate, _ = loss_and_grads(untied, ModelConfig(**TINY, tie_embeddings=False), ids, targets)
    assert "lm_head.weight" not in tied
    np.testing.assert_allclose(tied["tok_emb.weight"], separate["tok_emb.weight"] + separate["lm_head.weight"],
                               rtol=0, atol=1e-14)


def test_every_torch_family_is_registered_and_none_is_listed_unsupported():
    from qkv.models.build import ARCHITECTURES as TORCH_ARCHITECTURES
    from qkv.models.build import HEADS as TORCH_HEADS
    from qkv.ref.encoder import HEADS

    assert sorted(ARCHITECTURES.names()) == sorted(TORCH_ARCHITECTURES.names())
    assert sorted(HEADS.names()) == sorted(TORCH_HEADS.names())
    assert not any("encoder" in key for key in UNSUPPORTED)


def test_every_torch_variant_has_a_reference_twin():
    """Each choice of every variant axis of the torch engine exists in the reference engine's registry."""
    from qkv.nn.registries import AXES
    from qkv.ref.block import RESIDUALS
    from qkv.ref.ffn import FFNS
    from qkv.ref.functional import ACTIVATIONS
    from qkv.ref.kernels import KERNELS
    from qkv.ref.norms import NORMS
    from qkv.ref.positional import POSITIONALS

    ref = {"positional": POSITIONALS, "norm": NORMS, "norm_placement": RESIDUALS, "activation": ACTIVATIONS,
           "ffn": FFNS, "attention": KERNELS}
    for axis, registry in ref.items():
        assert sorted(registry.names()) == sorted(AXES[axis].names()), axis


def test_dropout_is_refused_with_a_clear_error():
    cfg = ModelConfig(**TINY, dropout=0.1)
    with pytest.raises(QkvError, match="model.dropout"):
        loss_and_grads({}, cfg, np.zeros((1, 2), dtype=int), np.zeros((1, 2), dtype=int))
