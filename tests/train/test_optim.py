"""Optimizers against hand-computed updates (SPEC B2, claim 27): decay groups, AdamW bias correction."""
import dataclasses

import numpy as np
import torch
import torch.nn.functional as F

from qkv.config import TrainConfig
from qkv.models import build_model
from qkv.train.optim import OPTIMIZERS, parameter_groups

TC = TrainConfig(lr=1e-2, weight_decay=0.1, beta1=0.9, beta2=0.95, eps=1e-8)


def loss_grads(model, seed: int) -> None:
    """Fill .grad with the gradient of a language-model loss on a random batch."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model.tok_emb.weight.shape[0], (2, 9), generator=g)
    model.zero_grad(set_to_none=True)
    F.cross_entropy(model(ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten()).backward()


def snapshot(model) -> dict[str, np.ndarray]:
    return {name: p.detach().double().numpy().copy() for name, p in model.named_parameters()}


def grads(model) -> dict[str, np.ndarray]:
    return {name: p.grad.double().numpy().copy() for name, p in model.named_parameters()}


def test_decay_groups_exclude_biases_and_norm_gains(tiny_cfg):
    model = build_model(tiny_cfg)
    decay, no_decay = parameter_groups(model, 0.1)
    names = {id(p): n for n, p in model.named_parameters()}
    decayed = {names[id(p)] for p in decay["params"]}
    kept = {names[id(p)] for p in no_decay["params"]}
    assert (decay["weight_decay"], no_decay["weight_decay"]) == (0.1, 0.0)
    assert decayed.isdisjoint(kept) and decayed | kept == set(names.values())
    assert all(n.endswith(".bias") or "norm" in n for n in kept)
    assert {n for n in names.values() if n.endswith(".bias") or "norm" in n} == kept
    assert {"tok_emb.weight", "positional.weight", "blocks.0.attn.q_proj.weight",
            "blocks.1.ffn.down_proj.weight"} <= decayed
    # a tied head is one parameter, counted once
    assert sum(p.numel() for g in (decay, no_decay) for p in g["params"]) == sum(
        p.numel() for p in model.parameters())


def hand_adamw(p, g, m, v, t, *, lr, wd, b1, b2, eps):
    """Loshchilov & Hutter AdamW as torch implements it: decay first, then the bias-corrected step."""
    p = p * (1 - lr * wd)
    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * g * g
    m_hat, v_hat = m / (1 - b1 ** t), v / (1 - b2 ** t)
    return p - lr * m_hat / (np.sqrt(v_hat) + eps), m, v


def test_adamw_three_steps_equal_hand_computed(tiny_cfg):
    model = build_model(tiny_cfg)
    optimizer = OPTIMIZERS.get("adamw")(model, TC)
    decayed = {n for n, p in model.named_parameters() if p.dim() >= 2}
    params = snapshot(model)
    moments = {n: (np.zeros_like(p), np.zeros_like(p)) for n, p in params.items()}
    for t in (1, 2, 3):
        loss_grads(model, seed=t)
        g = grads(model)
        optimizer.step()
        for name in params:
            wd = TC.weight_decay if name in decayed else 0.0
            params[name], *moments[name] = hand_adamw(params[name], g[name], *moments[name], t, lr=TC.lr, wd=wd,
                                                      b1=TC.beta1, b2=TC.beta2, eps=TC.eps)
        got = snapshot(model)
        for name in params:
            np.testing.assert_allclose(got[name], params[name], rtol=1e-5, atol=1e-7, err_msg=f"{name} step {t}")


def test_adamw_first_step_moves_every_coordinate_by_lr(tiny_cfg):
    """Bias correction: m_hat = g, v_hat = g^2 at t = 1, so the step is lr * g / (|g| + eps) ~ lr sign(g)."""
    model = build_model(tiny_cfg)
    optimizer = OPTIMIZERS.get("adamw")(model, TC)
    before = snapshot(model)
    loss_grads(model, seed=0)
    g = grads(model)
    optimizer.step()
    after = snapshot(model)
    checked = 0
    for name, p0 in before.items():
        wd = TC.weight_decay if p0.ndim >= 2 else 0.0
        step = p0 * (1 - TC.lr * wd) - after[name]  # the Adam part of the update
        big = np.abs(g[name]) > 1e-3  # eps / |g| < 1e-5
        np.testing.assert_allclose(np.abs(step[big]), TC.lr, rtol=2e-4, err_msg=name)
        np.testing.assert_array_equal(np.sign(step[big]), np.sign(g[name][big]))
        checked += int(big.sum())
    assert checked > 1000


def test_zero_grad_coordinate_only_decays(tiny_cfg):
    model = build_model(tiny_cfg)
    optimizer = OPTIMIZERS.get("adamw")(model, TC)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    before = snapshot(model)
    optimizer.step()
    for name, p in snapshot(model).items():
        wd = TC.weight_decay if p.ndim >= 2 else 0.0
        np.testing.assert_allclose(p, before[name] * (1 - TC.lr * wd), rtol=1e-6, atol=1e-9)


def test_adam_couples_l2_into_the_gradient(tiny_cfg):
    """Adam: g' = g + wd * theta enters the moments, so step 1 is lr * sign(g') (not decoupled)."""
    model = build_model(tiny_cfg)
    optimizer = OPTIMIZERS.get("adam")(model, TC)
    before = snapshot(model)
    loss_grads(model, seed=1)
    g = grads(model)
    optimizer.step()
    after = snapshot(model)
    for name, p0 in before.items():
        wd = TC.weight_decay if p0.ndim >= 2 else 0.0
        coupled = g[name] + wd * p0
        expected = p0 - TC.lr * coupled / (np.abs(coupled) + TC.eps)
        np.testing.assert_allclose(after[name], expected, rtol=1e-5, atol=1e-6, err_msg=name)


def test_sgd_momentum_two_steps(tiny_cfg):
    tc = dataclasses.replace(TC, lr=0.1)
    model = build_model(tiny_cfg)
    optimizer = OPTIMIZERS.get("sgd")(model, tc)
    params = snapshot(model)
    buf = {}
    for t in (1, 2):
        loss_grads(model, seed=t)
        g = grads(model)
        optimizer.step()
        for name, p in params.items():
            d = g[name] + (tc.weight_decay if p.ndim >= 2 else 0.0) * p
            buf[name] = d if t == 1 else tc.beta1 * buf[name] + d
            params[name] = p - tc.lr * buf[name]
        for name, p in snapshot(model).items():
            np.testing.assert_allclose(p, params[name], rtol=1e-5, atol=1e-7, err_msg=name)


def test_fused_adam_and_adamw_equal_the_per_tensor_loop(tiny_cfg):
    """The product optimizers run torch's fused kernel on CPU; five steps equal torch's per-tensor loop
    (foreach=False, fused=False) on the same gradients to float32 rounding."""
    for name, reference in (("adamw", torch.optim.AdamW), ("adam", torch.optim.Adam)):
        torch.manual_seed(0)
        fused_model = build_model(tiny_cfg)
        loop_model = build_model(tiny_cfg)
        loop_model.load_state_dict(fused_model.state_dict())
        fused = OPTIMIZERS.get(name)(fused_model, TC)
        assert fused.defaults["fused"] is True
        loop = reference(parameter_groups(loop_model, TC.weight_decay), lr=TC.lr, betas=(TC.beta1, TC.beta2),
                         eps=TC.eps, foreach=False, fused=False)
        for seed in range(5):
            for model, optimizer in ((fused_model, fused), (loop_model, loop)):
                loss_grads(model, seed)
                optimizer.step()
        got, want = snapshot(fused_model), snapshot(loop_model)
        moved = max(np.abs(want[n] - p).max() for n, p in snapshot(build_model(tiny_cfg)).items())
        assert moved > 1e-3  # the weights did move
        # a key bias adds the same q . b_k to every score of a row: softmax cancels it, so its gradient is
        # float rounding noise, which Adam's g / sqrt(v) turns into lr-sized steps in either implementation
        compared = [key for key in want if not key.endswith("k_proj.bias")]
        assert len(compared) > len(want) // 2
        for key in compared:
            np.testing.assert_allclose(got[key], want[key], rtol=1e-5, atol=1e-6, err_msg=f"{name} {key}")
