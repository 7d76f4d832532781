"""Training an MoE beyond note 002's balance loss: the router z-loss (ST-MoE) against its formula, in the step's
gradient as its weight says; DeepSeek-V3's auxiliary-loss-free balancing (the choosing bias moved by each step's
load) against a hand count, and, in a training run, spreading the load that a run without it leaves uneven; the
options refused where they do not apply."""
import dataclasses

import pytest
import torch
from torch.func import functional_call

from qkv.config import RunConfig
from qkv.errors import QkvError
from qkv.nn.linear_cross_entropy import cross_entropy
from qkv.nn.moe import MoE, Routing, aux_loss, nudge_choice_bias, z_loss
from qkv.train.checks import check_run
from qkv.train.loop import Trainer
from tests.train.test_loop import capture_grads, data, run_config


def moe_trainer(tmp_path, model: dict, **train) -> Trainer:
    cfg = run_config(**train)
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, moe_experts=4, moe_top_k=2, **model))
    path = tmp_path / "moe"
    path.mkdir(parents=True)
    return Trainer(path, cfg, data(), progress=False, log=lambda m: None)


def test_z_loss_is_the_mean_squared_logsumexp_of_the_router_logits():
    torch.manual_seed(0)
    layer = MoE(8, 12, experts=4, top_k=2, ffn="glu", activation="silu", bias=False).double()
    x = torch.randn(2, 5, 8, dtype=torch.float64)
    layer(x)
    logits = x.reshape(-1, 8) @ layer.router.weight.T
    expected = sum(float(torch.log(torch.exp(row).sum())) ** 2 for row in logits) / 10
    assert layer.z_loss.item() == pytest.approx(expected, rel=1e-12)

    def z_of(weight):  # the z-loss as a function of the router weights, for finite differences
        functional_call(layer, {"router.weight": weight}, (x,), strict=False)
        return layer.z_loss

    assert torch.autograd.gradcheck(z_of, (layer.router.weight.detach().clone().requires_grad_(),))


def test_the_step_adds_the_z_loss_with_its_weight(tmp_path):
    """The step's gradient == autograd of CE + alpha * aux + beta * z."""
    alpha, beta = 0.01, 0.5
    t = moe_trainer(tmp_path, {}, aux_loss_weight=alpha, router_z_loss_weight=beta, grad_clip=0.0)
    before = {name: p.detach().clone() for name, p in t.model.named_parameters()}
    seen = capture_grads(t)
    x, y = (torch.from_numpy(a) for a in t.batches.next())
    t.step(x, y, lr=1e-3)
    model = t.model
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(before[name])
    model.zero_grad()
    (cross_entropy(model(x), y) + alpha * aux_loss(model) + beta * z_loss(model)).backward()
    router = "blocks.0.ffn.router.weight"
    torch.testing.assert_close(seen[0][router], model.get_parameter(router).grad, rtol=1e-5, atol=1e-7)
    model.zero_grad()
    (cross_entropy(model(x), y) + alpha * aux_loss(model)).backward()
    assert not torch.allclose(model.get_parameter(router).grad, seen[0][router], rtol=1e-3)


def test_the_choosing_bias_moves_against_the_load_by_a_fixed_step():
    """b_e += gamma sign(mean load - load_e): loads 5, 1, 2, 0 (mean 2) move b by -g, +g, 0, +g; the count resets."""
    layer = MoE(8, 12, experts=4, top_k=1, ffn="mlp", activation="gelu", bias=False,
                routing=Routing(scoring="sigmoid"), choice_bias=True)
    layer.routed = torch.tensor([5.0, 1.0, 2.0, 0.0])
    nudge_choice_bias(layer, 0.25)
    assert layer.router_bias.tolist() == [-0.25, 0.25, 0.0, 0.25] and layer.routed is None
    layer.train()
    layer(torch.randn(1, 6, 8))
    assert layer.routed.sum().item() == 6  # one route a token, counted while training
    layer.eval()
    layer.routed = None
    layer(torch.randn(1, 6, 8))
    assert layer.routed is None  # not counted outside training


def test_training_with_the_bias_spreads_the_load(tmp_path):
    """Sigmoid routing whose choosing bias starts at +1 for expert 0 (in every token's top 2: half the routes):
    without gamma the bias stays (it has no gradient) and so does the load; with it each step moves the bias
    against the load, and the last steps' routes are near even (no aux loss in either run)."""
    loads = {}
    for rate in (0.0, 0.05):
        t = moe_trainer(tmp_path / str(rate), {"moe_scoring": "sigmoid", "moe_choice_bias": True},
                        aux_loss_weight=0.0, moe_bias_rate=rate, max_steps=40, lr=1e-3)
        with torch.no_grad():
            for block in t.model.blocks:
                block.ffn.router_bias[0] = 1.0
        for step in range(40):
            t.step(*(torch.from_numpy(a) for a in t.batches.next()), lr=1e-3)
        t.model.train()
        counted = torch.zeros(4)
        with torch.no_grad():
            x, _ = (torch.from_numpy(a) for a in t.batches.next())
            for block in t.model.blocks:
                block.ffn.routed = None
            t.model(x)
            for block in t.model.blocks:
                counted += block.ffn.routed
        loads[rate] = counted / counted.sum()
    assert loads[0.0][0] > 0.49  # expert 0 in every top 2
    assert loads[0.05].max() < 0.35, loads  # within 0.1 of the even 0.25


@pytest.mark.parametrize("model, train, message", [
    ({"moe_experts": 4}, {"moe_bias_rate": 0.01}, "set model.moe_choice_bias=true"),
    ({}, {"router_z_loss_weight": 0.1}, "needs routers"),
])
def test_balancing_options_that_do_not_apply_are_refused(model, train, message):
    cfg = RunConfig()
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, **model),
                              train=dataclasses.replace(cfg.train, **train))
    with pytest.raises(QkvError, match=message):
        check_run(cfg)


def test_a_router_gone_nan_in_training_is_a_skipped_step(tmp_path):
    """A NaN in a router makes the loss NaN: the guards skip the update, as for any non-finite loss."""
    t = moe_trainer(tmp_path, {})
    with torch.no_grad():
        t.model.blocks[0].ffn.router.weight[0, 0] = float("nan")
    before = {name: p.detach().clone() for name, p in t.model.named_parameters()}
    result = t.step(*(torch.from_numpy(a) for a in t.batches.next()), lr=1e-3)
    assert result.skipped
    for name, p in t.model.named_parameters():
        assert torch.equal(p, before[name]) or torch.isnan(before[name]).any(), name
