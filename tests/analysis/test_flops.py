"""FLOPs (SPEC F1, claims 19-20): the calculator against torch.utils.flop_counter on built models.

The counter counts 2 FLOPs per multiply-add, matmuls only, as the calculator does. It does not see inside
CPU sdpa (aten::_scaled_dot_product_flash_attention_for_cpu has no FLOP formula), so these models use the
naive kernel, whose Q K^T and A V are plain matmuls."""
import pytest
import torch

import qkv
from qkv import presets
from qkv.analysis import flops, params
from qkv.analysis.measure import count_flops
from qkv.config import ModelConfig
from qkv.models.build import ARCHITECTURES

BASE = dict(vocab_size=97, d_model=32, n_heads=4, n_layers=2, d_ff=64, max_seq_len=64, attention="naive")
CASES = [("decoder", {}), ("decoder", {"n_kv_heads": 1}), ("decoder", {"ffn": "glu", "activation": "silu", "bias": False}),
         ("decoder", {"tie_embeddings": False, "positional": "rope"}), ("decoder", {"moe_experts": 4, "moe_top_k": 2}),
         ("decoder", {"positional": "rope", "head_size": 12, "mla_kv_rank": 16, "mla_q_rank": 8, "mla_rope_dims": 4,
                      "mla_v_dims": 10}),
         ("decoder", {"positional": "rope", "head_size": 12, "mla_kv_rank": 16, "mla_rope_dims": 4}),
         ("decoder", {"moe_experts": 4, "moe_top_k": 2, "ffn": "glu", "bias": False, "moe_d_ff": 16,
                      "moe_shared_experts": 1, "moe_dense_layers": (1,), "moe_scoring": "sigmoid"}),
         ("encoder", {}), ("encoder", {"head": "mlm"}), ("encoder", {"head": "classifier", "n_classes": 3}),
         ("encoder-decoder", {"n_encoder_layers": 3, "n_decoder_layers": 2})]


def forward_call(model, cfg: ModelConfig, batch: int, seq: int):
    ids = torch.randint(0, cfg.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(0))
    if cfg.arch == "encoder-decoder":
        return lambda: model(ids, ids)
    return lambda: model(ids)


@pytest.mark.parametrize("arch,variant", CASES)
def test_forward_and_backward_within_5_percent_of_flop_counter(arch, variant):
    if arch not in ARCHITECTURES.names():
        pytest.skip(f"qkv.build_model cannot build arch={arch!r} yet")
    cfg = ModelConfig(arch=arch, **BASE, **variant)
    model = qkv.build_model(cfg)
    call = forward_call(model, cfg, batch=2, seq=24)
    counted, _ = count_flops(call)
    predicted = sum(flops.forward(cfg, batch=2, seq=24).values())
    assert counted == pytest.approx(predicted, rel=0.05)
    assert counted == predicted  # in fact exact: both count matmuls only (MoE: every token gets top_k experts)
    both, _ = count_flops(lambda: call().float().sum().backward())
    assert both == pytest.approx(3 * predicted, rel=0.05)  # backward = 2 x forward


@pytest.mark.parametrize("kernel", ["local", "dilated", "random"])
@pytest.mark.parametrize("T, S, window", [(256, 256, 4), (300, 300, 7), (512, 512, 16), (3, 64, 5), (512, 512, 256)])
def test_sparse_kernels_scores_are_the_ones_computed(kernel, T, S, window):
    """calc's score FLOPs of the sparse kernels (their registry entry's score_pairs) against the FLOP counter on
    the kernels themselves, also with cached keys (T < S) and a window larger than the blocks."""
    from qkv.nn.kernels import kernel_for

    q, k = torch.randn(1, 1, T, 8), torch.randn(1, 1, S, 8)
    fn = kernel_for(kernel, window=window)
    counted, _ = count_flops(lambda: fn(q, k, k, mask=None, causal=True, bias=None, scale=0.3))
    cfg = ModelConfig(**{**BASE, "attention": kernel, "window": window, "n_heads": 1, "d_model": 8})
    assert counted == flops.attention_scores(cfg, 1, T, S)  # (local with w = T/2 computes more than T x S)


@pytest.mark.parametrize("T, S", [(128, 128), (300, 300), (512, 512), (40, 300), (1, 200)])
def test_flash_counts_the_tiles_it_computes_under_the_causal_triangle(T, S):
    """flash skips, per key tile, the queries before its first key: the FLOP counter on the kernel's forward
    equals calc's causal score FLOPs (cached keys T < S too; one tile, or keys all before the queries, skip
    nothing; 0.625 of T x S at T = S = 512 with 128-column tiles), and without a causal mask every pair is
    computed."""
    from qkv.nn.kernels import kernel_for

    cfg = ModelConfig(**{**BASE, "attention": "flash", "n_heads": 1, "d_model": 8, "max_seq_len": 512})
    q, k = torch.randn(1, 1, T, 8, requires_grad=True), torch.randn(1, 1, S, 8)
    fn = kernel_for("flash")
    counted, _ = count_flops(lambda: fn(q, k, k, mask=None, causal=True, bias=None, scale=0.3))
    assert counted == flops.attention_scores(cfg, 1, T, S, causal=True)
    assert counted <= flops.attention_scores(cfg, 1, T, S)
    if T == S == 512:
        assert counted == 0.625 * flops.attention_scores(cfg, 1, T, S)  # (4 + 3 + 2 + 1) / 16 of the tiles
    full, _ = count_flops(lambda: fn(q, k, k, mask=None, causal=False, bias=None, scale=0.3))
    assert full == flops.attention_scores(cfg, 1, T, S)


def test_sparse_kernel_model_flops_match_the_counter():
    cfg = ModelConfig(**{**BASE, "attention": "dilated", "window": 4})
    model = qkv.build_model(cfg)
    counted, _ = count_flops(forward_call(model, cfg, batch=2, seq=24))
    assert counted == sum(flops.forward(cfg, batch=2, seq=24).values())


def test_note_layer_costs_in_flops():
    """Note 000 §10: 2n^2 d + 4 n d^2 multiply-adds per attention layer; §9.3: 8 n d^2 for the FFN."""
    n, d = 100, 64
    cfg = ModelConfig(vocab_size=10, d_model=d, n_heads=8, n_layers=1, d_ff=4 * d, max_seq_len=n, bias=False)
    f = flops.forward(cfg, batch=1, seq=n)
    assert f["attention_projections"] + f["attention_scores"] == 2 * (2 * n * n * d + 4 * n * d * d)
    assert f["ffn"] == 2 * 8 * n * d * d
    assert f["lm_head"] == 2 * n * d * 10


def test_gpt3_six_nd():
    """6ND = 3.14e23 for 175B parameters and 300B tokens (note 000 LLM §8.1)."""
    counts = params.breakdown(presets.get("gpt3-175b").model)
    assert flops.six_nd(counts["total"], 300e9) == pytest.approx(3.14e23, rel=0.005)
    exact = flops.train_flops_per_token(presets.get("gpt3-175b").model, 2048) * 300e9
    assert exact == pytest.approx(6 * counts["non_embedding"] * 300e9, rel=0.05)  # attention scores add ~3%


def test_mfu():
    cfg = ModelConfig(vocab_size=100, d_model=64, n_heads=4, n_layers=2, d_ff=256, max_seq_len=128)
    per_token = flops.train_flops_per_token(cfg, 128)
    assert per_token == 3 * sum(flops.forward(cfg, batch=1, seq=128).values()) / 128
    assert flops.mfu(cfg, seq=128, tokens_per_s=1e6, peak_flops=per_token * 2e6) == pytest.approx(0.5)
    with pytest.raises(qkv.QkvError):
        flops.mfu(cfg, seq=128, tokens_per_s=1.0, peak_flops=0)
