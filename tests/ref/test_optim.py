"""qkv.ref.optim: SGD with momentum, Adam, AdamW and Muon + AdamW against torch.optim and the torch engine's
Muon in float64, Adam's bias correction, and global-norm clipping against torch.nn.utils.clip_grad_norm_."""
from dataclasses import replace

import numpy as np
import pytest
import torch

import qkv
from qkv.config import TrainConfig
from qkv.formats.params import to_numpy
from qkv.ref.optim import OPTIMIZERS, clip_grad_norm


@pytest.mark.parametrize("name", ["adamw", "adam", "sgd"])
def test_optimizer_matches_torch_optim(name):
    rng = np.random.default_rng(0)
    tc = TrainConfig(lr=0.05, weight_decay=0.1, beta1=0.9, beta2=0.95)
    params = {"w": rng.normal(size=(3, 4)), "b": rng.normal(size=4)}  # w decays, b does not
    tensors = {k: torch.tensor(v, requires_grad=True) for k, v in params.items()}
    groups = [{"params": [tensors["w"]], "weight_decay": tc.weight_decay},
              {"params": [tensors["b"]], "weight_decay": 0.0}]
    reference = {"adamw": lambda: torch.optim.AdamW(groups, lr=tc.lr, betas=(tc.beta1, tc.beta2), eps=tc.eps),
                 "adam": lambda: torch.optim.Adam(groups, lr=tc.lr, betas=(tc.beta1, tc.beta2), eps=tc.eps),
                 "sgd": lambda: torch.optim.SGD(groups, lr=tc.lr, momentum=tc.beta1)}[name]()
    ours = OPTIMIZERS.get(name)(replace(tc, optimizer=name))
    for step in range(6):
        grads = {k: rng.normal(size=v.shape) for k, v in params.items()}
        lr = tc.lr * (1 + step) / 6  # a changing lr, as under a schedule
        for k, t in tensors.items():
            t.grad = torch.tensor(grads[k])
        for group in reference.param_groups:
            group["lr"] = lr
        reference.step()
        ours.step(params, grads, lr)
    for k in params:
        np.testing.assert_allclose(params[k], tensors[k].detach().numpy(), rtol=0, atol=1e-13)


def test_adam_first_update_has_magnitude_lr():
    """Bias correction (LLM §4.1): m_hat / sqrt(v_hat) = g / |g| at t = 1, so each weight moves by lr."""
    params, grads = {"b": np.array([1.0, 2.0, -3.0])}, {"b": np.array([1e-3, -5.0, 40.0])}
    OPTIMIZERS.get("adam")(TrainConfig(weight_decay=0.0, eps=1e-12)).step(params, grads, 0.1)
    np.testing.assert_allclose(params["b"], [0.9, 2.1, -3.1], atol=1e-9)


@pytest.mark.parametrize("max_norm", [0.5, 100.0])
def test_clip_grad_norm_matches_torch(max_norm):
    rng = np.random.default_rng(1)
    grads = {"a": rng.normal(size=(3, 3)), "b": rng.normal(size=5)}
    tensors = [torch.zeros(v.shape, dtype=torch.float64, requires_grad=True) for v in grads.values()]
    for t, g in zip(tensors, grads.values()):
        t.grad = torch.tensor(g)
    norm_torch = torch.nn.utils.clip_grad_norm_(tensors, max_norm).item()
    norm = clip_grad_norm(grads, max_norm)
    assert abs(norm - norm_torch) < 1e-12
    for t, g in zip(tensors, grads.values()):
        np.testing.assert_allclose(g, t.grad.numpy(), rtol=0, atol=1e-15)


@pytest.mark.parametrize("iteration", ["polar_express", "jordan"])
def test_muon_matches_the_torch_engines_muon_for_six_steps(iteration):
    """The NumPy Muon (hidden matrices) + AdamW (the rest) against qkv.train.muon in float64, through a
    changing rate applied as the Trainer applies it (each group's lr_scale), with each Newton-Schulz iteration."""
    from qkv.train.muon import muon

    torch.manual_seed(0)
    cfg = qkv.ModelConfig(vocab_size=20, d_model=8, n_heads=2, n_layers=2, d_ff=24, max_seq_len=8)
    model = qkv.build_model(cfg).double()
    tc = TrainConfig(optimizer="muon", lr=0.01, muon_lr=0.05, muon_momentum=0.9, weight_decay=0.1,
                     muon_iteration=iteration)
    params = to_numpy(model)
    reference, ours = muon(model, tc), OPTIMIZERS.get("muon")(tc)
    rng = np.random.default_rng(0)
    for step in range(6):
        grads = {k: rng.normal(size=v.shape) for k, v in params.items()}
        lr = tc.lr * (1 + step) / 6
        for name, p in model.named_parameters():
            p.grad = torch.tensor(grads[name])
        for group in reference.param_groups:
            group["lr"] = lr * group.get("lr_scale", 1.0)
        reference.step()
        ours.step(params, grads, lr)
    for name, p in model.named_parameters():
        np.testing.assert_allclose(params[name], p.detach().numpy(), rtol=0, atol=1e-12, err_msg=name)
