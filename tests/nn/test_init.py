import math

import pytest
import torch

from qkv.models.context import self_context

from qkv.config import ModelConfig
from qkv.models import build_model
from qkv.nn.init import INITS

WIDE = dict(vocab_size=64, d_model=256, n_heads=4, n_layers=3, d_ff=512, max_seq_len=64, tie_embeddings=False)


def relative_std_tolerance(n: int) -> float:
    """Sample std of n iid normals has relative standard error 1/sqrt(2n); allow 5 of them."""
    return 5 / math.sqrt(2 * n)


def assert_std(weight: torch.Tensor, std: float):
    measured = weight.detach().double().std().item()
    assert measured == pytest.approx(std, rel=relative_std_tolerance(weight.numel())), (measured, std)
    assert abs(weight.detach().double().mean().item()) < 5 * std / math.sqrt(weight.numel())


def linear_weights(model):
    return {name: m.weight for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}


def test_registry_holds_the_schemes():
    assert {"gpt2", "xavier", "kaiming", "zero_out"} <= set(INITS.names())


def test_zero_out_starts_every_block_as_the_identity():
    """o_proj and down_proj are exactly zero (the rest N(0, std)), so each block returns its input: the
    final hidden state before the last norm is the embedding."""
    model = build_model(ModelConfig(**WIDE, init="zero_out", init_std=0.02)).eval()
    for name, weight in linear_weights(model).items():
        if name.endswith(("attn.o_proj", "ffn.down_proj")):
            assert not weight.any(), name
        elif name != "lm_head":
            assert_std(weight, 0.02)
    ids = torch.randint(0, 64, (2, 9))
    x = model.embed(ids, torch.arange(9).expand(2, 9))
    ctx = self_context(model.positional, ids, None, None, causal=True)
    out = x
    for block in model.blocks:
        out = block(out, ctx)
    torch.testing.assert_close(out, x, rtol=0, atol=0)


def test_gpt2_init_std_and_scaled_residual_projections():
    """N(0, 0.02) everywhere; o_proj and down_proj N(0, 0.02 / sqrt(2L)) (GPT-2 §2.3)."""
    model = build_model(ModelConfig(**WIDE, init="gpt2", init_std=0.02))
    residual_std = 0.02 / math.sqrt(2 * 3)
    for name, weight in linear_weights(model).items():
        is_residual = name.endswith(("attn.o_proj", "ffn.down_proj"))
        assert_std(weight, residual_std if is_residual else 0.02)
    assert_std(model.tok_emb.weight, 0.02)
    assert_std(model.positional.weight, 0.02)


@pytest.mark.parametrize("init", INITS.names())
def test_every_scheme_zeroes_linear_biases_and_leaves_norms_at_identity(init):
    model = build_model(ModelConfig(**{**WIDE, "d_model": 32, "d_ff": 64}, init=init))
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and module.bias is not None:
            assert torch.count_nonzero(module.bias) == 0, name
    for name, param in model.named_parameters():
        if "norm" in name:
            expected = 1.0 if name.endswith("weight") else 0.0
            assert torch.all(param == expected), name


def test_xavier_uniform_bound_and_std():
    """U(-a, a), a = sqrt(6 / (fan_in + fan_out)); its std is a / sqrt(3)."""
    model = build_model(ModelConfig(**WIDE, init="xavier"))
    for name, weight in linear_weights(model).items():
        fan_out, fan_in = weight.shape
        bound = math.sqrt(6 / (fan_in + fan_out))
        assert weight.abs().max().item() <= bound, name
        assert weight.abs().max().item() > 0.99 * bound, name  # the whole interval is used
        assert_std(weight, bound / math.sqrt(3))
    assert_std(model.tok_emb.weight, 0.02)


def test_kaiming_normal_std_is_sqrt_two_over_fan_in():
    model = build_model(ModelConfig(**WIDE, init="kaiming"))
    for name, weight in linear_weights(model).items():
        assert_std(weight, math.sqrt(2 / weight.shape[1]))
    assert_std(model.tok_emb.weight, 0.02)


def test_init_std_setting_is_used():
    model = build_model(ModelConfig(**WIDE, init="gpt2", init_std=0.05))
    assert_std(model.blocks[0].attn.q_proj.weight, 0.05)
    assert_std(model.blocks[0].attn.o_proj.weight, 0.05 / math.sqrt(6))


@pytest.mark.parametrize("init", ["xavier", "kaiming"])
def test_a_tied_embedding_keeps_the_embedding_init_not_the_linear_one(init):
    """W_out = W_E is one tensor: it is initialised once, as the embedding (N(0, std)), whatever order
    the modules are visited in."""
    model = build_model(ModelConfig(**{**WIDE, "tie_embeddings": True}, init=init, init_std=0.02))
    assert model.lm_head.weight is model.tok_emb.weight
    assert_std(model.tok_emb.weight, 0.02)


def test_small_init_follows_note_000_llm_6_1():
    """W^Q, W^K, W^V ~ N(0, sqrt(2 / (5 D))), smaller than Xavier; W^O and the FFN Xavier uniform."""
    model = build_model(ModelConfig(**WIDE, init="small"))
    for name, weight in linear_weights(model).items():
        fan_out, fan_in = weight.shape
        xavier_bound = math.sqrt(6 / (fan_in + fan_out))
        if name.endswith(("q_proj", "k_proj", "v_proj")):
            assert_std(weight, math.sqrt(2 / (5 * 256)))
            assert math.sqrt(2 / (5 * 256)) < xavier_bound / math.sqrt(3)  # "smaller": below Xavier's std
        else:
            assert weight.abs().max().item() <= xavier_bound, name
            assert_std(weight, xavier_bound / math.sqrt(3))
    assert_std(model.tok_emb.weight, 0.02)


def test_scaled_init_scales_the_residual_projections_by_one_over_sqrt_2l():
    scaled = build_model(ModelConfig(**WIDE, init="scaled"))
    for name, weight in linear_weights(scaled).items():
        fan_out, fan_in = weight.shape
        xavier_std = math.sqrt(6 / (fan_in + fan_out)) / math.sqrt(3)
        if name.endswith(("o_proj", "down_proj")):
            assert_std(weight, xavier_std / math.sqrt(2 * 3))
        elif name.endswith(("q_proj", "k_proj", "v_proj")):
            assert_std(weight, math.sqrt(2 / (5 * 256)))
        else:
            assert_std(weight, xavier_std)
