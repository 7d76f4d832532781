import dataclasses
import itertools

import pytest
import torch

from qkv.config import ModelConfig
from qkv.errors import QkvError
from qkv.models import build_model
from qkv.nn import registries
from tests.models.derivative import assert_gradient_is_the_derivative

# Every variant axis that shapes the network, with its values from the registries, so a new variant is
# covered here with no new test code. The full product (thousands of builds) is replaced by: each axis
# varied alone from the default, plus every pair of values of the axes that interact most (positions with
# kernels and placements, kernels with placements and FFNs).
AXES = {axis: registries.get(axis).names() for axis in
        ("positional", "norm", "norm_placement", "activation", "ffn", "attention")}
AXES["moe_experts"] = [0, 3]
PAIRED_AXES = ("positional", "attention", "norm_placement", "ffn")
DEFAULT = dict(positional="learned", norm="layernorm", norm_placement="pre", activation="gelu", ffn="mlp",
               attention="sdpa", moe_experts=0)


def variant_combinations() -> list[dict]:
    combos = [dict(DEFAULT, **{axis: value}) for axis, values in AXES.items() for value in values]
    for first, second in itertools.combinations(PAIRED_AXES, 2):
        combos += [dict(DEFAULT, **{first: a, second: b}) for a in AXES[first] for b in AXES[second]]
    unique = {tuple(sorted(c.items())): c for c in combos}
    return list(unique.values())


COMBINATIONS = variant_combinations()


def combination_id(values: dict) -> str:
    return "-".join(str(values[axis]) for axis in AXES)


@pytest.mark.parametrize("values", COMBINATIONS, ids=[combination_id(v) for v in COMBINATIONS])
def test_every_variant_combination_is_causal_and_its_gradient_is_the_derivative(values):
    """Each built decoder: no position's logits depend on a later token (the causal mask, whatever the
    kernel and positions), every parameter gets a gradient, and that gradient is the loss's derivative
    (a central difference along it, float64)."""
    cfg = ModelConfig(vocab_size=16, d_model=8, n_heads=2, n_kv_heads=1, n_layers=1, d_ff=12, max_seq_len=8,
                      window=2, moe_top_k=2, **values)
    model = build_model(cfg).double()
    ids = torch.randint(0, 16, (2, 5))
    logits = model(ids)
    later = ids.clone()
    later[:, -1] = (later[:, -1] + 1) % 16
    torch.testing.assert_close(model(later)[:, :-1], logits[:, :-1], rtol=0, atol=1e-12)
    assert not torch.allclose(model(later)[:, -1], logits[:, -1])
    loss_of = lambda m: torch.nn.functional.cross_entropy(m(ids).flatten(0, 1), ids.roll(-1, 1).flatten())  # noqa: E731
    loss_of(model).backward()
    assert all(param.grad is not None for param in model.parameters())
    assert_gradient_is_the_derivative(model, loss_of)


def test_the_combinations_cover_every_value_and_every_pair_of_the_paired_axes():
    for axis, values in AXES.items():
        assert {c[axis] for c in COMBINATIONS} == set(values)
    for first, second in itertools.combinations(PAIRED_AXES, 2):
        assert {(c[first], c[second]) for c in COMBINATIONS} == set(itertools.product(AXES[first], AXES[second]))
    assert len(COMBINATIONS) < 250


@pytest.mark.parametrize("init", registries.get("init").names())
def test_every_init_builds_a_finite_model(tiny_cfg, init):
    model = build_model(dataclasses.replace(tiny_cfg, init=init))
    assert torch.isfinite(model(torch.randint(0, 32, (1, 4)))).all()


def test_build_validates_the_config(tiny_cfg):
    with pytest.raises(QkvError, match="model.norm='batchnorm' is not allowed; choose from: layernorm, rmsnorm"):
        build_model(dataclasses.replace(tiny_cfg, norm="batchnorm"))


def expected_parameter_count(cfg: ModelConfig) -> int:
    """Counted from the formulas: embeddings, learned positions, per layer 4 projections (K/V at Hkv heads),
    an MLP and two LayerNorms, then the final LayerNorm of a pre-LN stack; the head is tied."""
    D, F, V, L = cfg.d_model, cfg.d_ff, cfg.vocab_size, cfg.n_layers
    kv = cfg.kv_heads * cfg.head_dim
    attention = (D * D + D) * 2 + (D * kv + kv) * 2  # q, o and k, v with biases
    mlp = D * F + F + F * D + D
    norms = 2 * 2 * D
    return V * D + cfg.max_seq_len * D + L * (attention + mlp + norms) + 2 * D


@pytest.mark.parametrize("n_kv_heads", [0, 2, 1])
def test_parameter_count_matches_the_formula(tiny_cfg, n_kv_heads):
    cfg = dataclasses.replace(tiny_cfg, n_kv_heads=n_kv_heads)
    model = build_model(cfg)
    assert sum(p.numel() for p in model.parameters()) == expected_parameter_count(cfg)


def test_parameter_names_are_the_stable_interop_names(tiny_cfg):
    """interop.py and the NumPy engine copy parameters by these names (STYLE.md 9)."""
    model = build_model(dataclasses.replace(tiny_cfg, n_layers=1))
    assert list(model.state_dict()) == [
        "tok_emb.weight", "positional.weight",
        "blocks.0.attn_norm.weight", "blocks.0.attn_norm.bias",
        "blocks.0.attn.q_proj.weight", "blocks.0.attn.q_proj.bias", "blocks.0.attn.k_proj.weight",
        "blocks.0.attn.k_proj.bias", "blocks.0.attn.v_proj.weight", "blocks.0.attn.v_proj.bias",
        "blocks.0.attn.o_proj.weight", "blocks.0.attn.o_proj.bias",
        "blocks.0.ffn_norm.weight", "blocks.0.ffn_norm.bias",
        "blocks.0.ffn.up_proj.weight", "blocks.0.ffn.up_proj.bias",
        "blocks.0.ffn.down_proj.weight", "blocks.0.ffn.down_proj.bias",
        "final_norm.weight", "final_norm.bias", "lm_head.weight",
    ]


def test_post_ln_stack_has_no_final_norm(tiny_cfg):
    model = build_model(dataclasses.replace(tiny_cfg, norm_placement="post"))
    assert isinstance(model.final_norm, torch.nn.Identity)
    x = torch.randn(3, 16)
    assert model.final_norm(x) is x


@pytest.mark.parametrize("placement", registries.get("norm_placement").names())
def test_model_bias_false_removes_every_norm_and_linear_bias(tiny_cfg, placement):
    """model.bias reaches the norms (LayerNorm without beta) as well as the linears, for every placement."""
    model = build_model(dataclasses.replace(tiny_cfg, bias=False, norm_placement=placement))
    assert not [name for name, _ in model.named_parameters() if name.endswith(".bias")]
    with_bias = build_model(dataclasses.replace(tiny_cfg, norm_placement=placement))
    assert any(name.endswith("norm.bias") or name.endswith("inner.bias") for name, _ in with_bias.named_parameters())


def test_sandwich_has_two_norms_per_sublayer_and_a_final_norm(tiny_cfg):
    model = build_model(dataclasses.replace(tiny_cfg, norm_placement="sandwich"))
    names = [name for name, _ in model.named_parameters() if "blocks.0." in name and "norm" in name]
    assert names == [f"blocks.0.{sub}_norm.{side}.{p}" for sub in ("attn", "ffn") for side in ("inner", "outer")
                     for p in ("weight", "bias")]
    assert not isinstance(model.final_norm, torch.nn.Identity)
