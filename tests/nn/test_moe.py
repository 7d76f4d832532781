"""Mixture-of-Experts FFN: routing, gates, capacity and the load-balancing loss against hand computations."""
import dataclasses
import math

import pytest
import torch

from qkv.config import ModelConfig
from qkv.models import build_model
from qkv.nn.ffn import FFNS
from qkv.nn.moe import MoE, aux_loss

D, F_ = 6, 10


def moe(experts=3, top_k=2, capacity_factor=0.0, ffn="mlp"):
    layer = MoE(D, F_, experts=experts, top_k=top_k, capacity_factor=capacity_factor, ffn=ffn,
                activation="gelu", bias=True).double()
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn_like(p) * 0.5)
    return layer


def hand_moe(layer, x):
    """y_n = sum over the k largest router logits e of softmax(chosen logits)_e FFN_e(x_n), token by token."""
    out = torch.zeros_like(x)
    for n in range(x.shape[0]):
        logits = layer.router.weight @ x[n]  # (E,)
        chosen = sorted(range(len(logits)), key=lambda e: -logits[e])[:layer.top_k]
        gates = torch.softmax(logits[chosen], 0)
        for g, e in zip(gates, chosen):
            out[n] += g * layer.experts[e](x[n][None])[0]
    return out


@pytest.mark.parametrize("ffn", FFNS.names())
def test_one_expert_with_top_1_is_the_dense_ffn(ffn):
    layer = moe(experts=1, top_k=1, ffn=ffn)
    dense = FFNS.get(ffn)(D, F_, activation="gelu", bias=True).double()
    dense.load_state_dict({k.removeprefix("experts.0."): v for k, v in layer.state_dict().items()
                           if k.startswith("experts.0.")})
    x = torch.randn(2, 5, D, dtype=torch.float64)
    torch.testing.assert_close(layer(x), dense(x), rtol=0, atol=1e-14)
    assert layer.aux_loss.item() == pytest.approx(1.0)  # E f P = 1 * 1 * 1


@pytest.mark.parametrize("top_k", [1, 2, 3])
def test_output_is_the_gate_weighted_sum_of_the_chosen_experts(top_k):
    layer = moe(experts=4, top_k=top_k)
    x = torch.randn(2, 5, D, dtype=torch.float64)
    torch.testing.assert_close(layer(x).view(10, D), hand_moe(layer, x.view(10, D)), rtol=1e-12, atol=1e-12)


def test_aux_loss_is_e_times_sum_of_route_share_times_mean_probability():
    layer = moe(experts=4, top_k=2)
    x = torch.randn(3, 7, D, dtype=torch.float64)
    layer(x)
    tokens = x.view(21, D)
    probs = torch.softmax(tokens @ layer.router.weight.T, -1)  # (N, E)
    top = probs.topk(2, -1).indices
    f = [(top == e).sum().item() / top.numel() for e in range(4)]
    P = probs.mean(0)
    expected = 4 * sum(f[e] * P[e] for e in range(4))
    assert layer.aux_loss.item() == pytest.approx(expected.item(), abs=1e-12)
    grad = torch.autograd.grad(layer.aux_loss, layer.router.weight)[0]  # differentiable through P
    assert grad.abs().max() > 0


def test_balanced_routing_gives_aux_loss_one_and_collapse_gives_e():
    layer = moe(experts=4, top_k=1)
    with torch.no_grad():
        layer.router.weight.zero_()  # uniform p = 1/E: sum_e f_e / E * E = 1 whatever f is
    layer(torch.randn(1, 8, D, dtype=torch.float64))
    assert layer.aux_loss.item() == pytest.approx(1.0)
    with torch.no_grad():
        layer.router.weight.zero_()
        layer.router.weight[2] = 1000 * torch.ones(D)  # every token to expert 2 with p ~ 1
    layer(torch.ones(1, 8, D, dtype=torch.float64))
    assert layer.aux_loss.item() == pytest.approx(4.0)


def test_capacity_drops_the_routes_past_each_experts_capacity():
    """8 tokens, top-1, E = 2, factor 0.5: capacity ceil(0.5 * 8 / 2) = 2. All tokens prefer expert 0:
    tokens 0, 1 are served, tokens 2.. leave the FFN as 0 (the residual carries them)."""
    layer = moe(experts=2, top_k=1, capacity_factor=0.5)
    with torch.no_grad():
        layer.router.weight.zero_()
        layer.router.weight[0] = 10.0
    x = torch.rand(1, 8, D, dtype=torch.float64) + 0.1  # positive: expert 0 wins everywhere
    out = layer(x)[0]
    full = layer.experts[0](x[0])
    torch.testing.assert_close(out[:2], full[:2], rtol=1e-12, atol=1e-12)  # gate 1 (top-1 softmax)
    assert torch.equal(out[2:], torch.zeros(6, D, dtype=torch.float64))


def test_capacity_serves_positions_in_order_and_a_tokens_choices_in_order():
    layer = moe(experts=2, top_k=2, capacity_factor=0.5)  # capacity ceil(0.5 * 4 * 2 / 2) = 2 routes each
    top = torch.tensor([[[0, 1], [0, 1], [1, 0], [0, 1]]])  # (B=1, T=4, k=2)
    # queue: t0 -> e0, e1 (kept), t1 -> e0, e1 (kept: both experts full), t2, t3 dropped
    assert layer.within_capacity(top).tolist() == [[True, True], [True, True], [False, False], [False, False]]
    two_rows = torch.tensor([[[0, 1], [1, 0]], [[0, 1], [0, 1]]])  # (B=2, T=2): position 0 of both rows first
    assert layer.within_capacity(two_rows).tolist() == [[True, True], [False, False], [True, True], [False, False]]


def test_capacity_keeps_the_decoder_causal():
    """A later token never takes an earlier token's place: changing it leaves earlier outputs unchanged."""
    layer = moe(experts=2, top_k=2, capacity_factor=0.5)
    x = torch.randn(2, 8, D, dtype=torch.float64)
    changed = x.clone()
    changed[:, 5:] = torch.randn(2, 3, D, dtype=torch.float64)
    out, out_changed = layer(x), layer(changed)
    torch.testing.assert_close(out_changed[:, :5], out[:, :5], rtol=0, atol=0)
    assert (out == 0).all(-1).any()  # some tokens were dropped: capacity did act


def test_model_aux_loss_sums_every_layer_and_is_zero_without_moe():
    cfg = ModelConfig(vocab_size=16, d_model=8, n_heads=2, n_layers=3, d_ff=12, max_seq_len=8, moe_experts=3,
                      moe_top_k=1)
    model = build_model(cfg)
    model(torch.randint(0, 16, (2, 5)))
    layers = [block.ffn for block in model.blocks]
    assert all(isinstance(layer, MoE) for layer in layers)
    torch.testing.assert_close(aux_loss(model), sum(layer.aux_loss for layer in layers))
    assert math.isfinite(aux_loss(model).item()) and aux_loss(model).item() > 0
    dense = build_model(dataclasses.replace(cfg, moe_experts=0))
    dense(torch.randint(0, 16, (2, 5)))
    assert aux_loss(dense).item() == 0.0


def test_parameter_names_follow_the_reference_engine():
    names = list(moe(experts=2).state_dict())
    assert names[0] == "router.weight" and "experts.1.down_proj.weight" in names
