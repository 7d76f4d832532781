"""Training with no autograd: the reference engine's optimizers, clipping, schedule and loop against
torch.optim and a plain torch float64 loop written here."""
import math
from dataclasses import replace

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import qkv
from qkv.config import TrainConfig
from qkv.data.dataset import Batches
from qkv.interop import to_numpy
from qkv.ref.optim import OPTIMIZERS, clip_grad_norm
from qkv.ref.train import learning_rate, train_ref, train_step
from qkv.train.schedules import SCHEDULES


def torch_loop_lr(step, tc, total):
    """The schedule the torch loop (qkv.train.loop) uses: qkv.train.schedules, shared by both engines."""
    return SCHEDULES.get(tc.schedule)(step, lr=tc.lr, min_lr=tc.min_lr, warmup=tc.warmup_steps, total=total, d_model=32)


def test_tiny_preset_trains_like_torch_for_20_steps():
    cfg = qkv.presets.get("tiny")
    torch.manual_seed(cfg.train.seed)
    model = qkv.build_model(cfg.model).double()
    params = to_numpy(model)
    period = np.random.default_rng(0).integers(0, cfg.model.vocab_size, 40)
    tokens = np.tile(period, 100)  # a learnable stream: it repeats every 40 tokens
    draw = Batches(tokens, cfg.train.seq_len, cfg.train.batch_size, seed=1)
    batches = [draw.next() for _ in range(20)]

    losses = train_ref(params, cfg, batches, steps=20)

    tc = cfg.train
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": tc.weight_decay},
                                   {"params": rest, "weight_decay": 0.0}],
                                  lr=tc.lr, betas=(tc.beta1, tc.beta2), eps=tc.eps)
    expected, clipped = [], 0
    for step, (x, y) in enumerate(batches):
        for group in optimizer.param_groups:
            group["lr"] = torch_loop_lr(step, tc, 20)
        loss = F.cross_entropy(model(torch.from_numpy(x)).flatten(0, 1), torch.from_numpy(y).flatten())
        loss.backward()
        clipped += torch.nn.utils.clip_grad_norm_(model.parameters(), tc.grad_clip).item() > tc.grad_clip
        optimizer.step()
        optimizer.zero_grad()
        expected.append(loss.item())
    np.testing.assert_allclose(losses, expected, rtol=0, atol=1e-8)
    assert losses[-1] < losses[0] - 0.5  # it learns
    final = to_numpy(model)
    assert max(np.abs(final[n] - params[n]).max() for n in params) < 1e-8
    assert clipped > 0  # the clipping branch ran


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


def test_cosine_schedule_endpoints():
    """Warmup lr * (step + 1) / warmup, peak lr at step warmup, min_lr at the last step total - 1."""
    tc = TrainConfig(lr=1e-3, min_lr=1e-4, warmup_steps=10)
    assert learning_rate(tc, 0, 100, 32) == pytest.approx(1e-4)
    assert learning_rate(tc, 9, 100, 32) == pytest.approx(1e-3)
    assert learning_rate(tc, 10, 100, 32) == pytest.approx(1e-3)
    assert learning_rate(tc, 55, 100, 32) == pytest.approx(1e-4 + 0.45e-3 * (1 + math.cos(math.pi * 45 / 89)))
    assert learning_rate(tc, 99, 100, 32) == pytest.approx(1e-4)


def test_accumulation_equals_the_large_batch():
    """LLM §10.4: the mean over k equal micro-batches of the micro-batch gradient is the batch gradient."""
    cfg = qkv.ModelConfig(vocab_size=11, d_model=8, n_heads=2, n_layers=1, d_ff=12, max_seq_len=8)
    params = to_numpy(qkv.build_model(cfg).double())
    x, y = np.random.default_rng(0).integers(0, 11, (2, 4, 5))
    results = []
    for k in (1, 2):
        p = {n: v.copy() for n, v in params.items()}
        tc = TrainConfig(accumulation=k, batch_size=4)
        loss, norm = train_step(p, cfg, tc, OPTIMIZERS.get("adamw")(tc), x, y, lr=1e-2)
        results.append((loss, norm, p))
    assert abs(results[0][0] - results[1][0]) < 1e-14 and abs(results[0][1] - results[1][1]) < 1e-14
    assert max(np.abs(results[0][2][n] - results[1][2][n]).max() for n in params) < 1e-14


def test_seq2seq_batches_train_like_torch_with_accumulation():
    """train_ref on the seq2seq objective's 5-tuple batches (src, src_mask, tgt_in, tgt_mask, labels), padded
    sources, accumulation 2: the same losses and weights as torch autograd + torch.optim.AdamW, 5 steps."""
    model_cfg = qkv.ModelConfig(arch="encoder-decoder", vocab_size=11, d_model=8, n_heads=2, n_layers=1, d_ff=12,
                                max_seq_len=8, positional="t5")
    cfg = replace(qkv.presets.get("tiny"), model=model_cfg,
                  train=TrainConfig(batch_size=4, accumulation=2, lr=1e-2, warmup_steps=2, grad_clip=0.5))
    torch.manual_seed(0)
    model = qkv.build_model(model_cfg).double()
    params = to_numpy(model)
    rng = np.random.default_rng(0)
    batches = []
    for _ in range(5):
        src, tgt, labels = rng.integers(0, 11, (3, 4, 5))
        src_mask, tgt_mask = np.ones((4, 5), dtype=np.int64), np.ones((4, 5), dtype=np.int64)
        src_mask[1, :2] = 0
        batches.append((src, src_mask, tgt, tgt_mask, np.where(rng.random((4, 5)) < 0.2, -100, labels)))

    losses = train_ref(params, cfg, batches, steps=5)

    tc = cfg.train
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": tc.weight_decay},
                                   {"params": rest, "weight_decay": 0.0}],
                                  lr=tc.lr, betas=(tc.beta1, tc.beta2), eps=tc.eps)
    expected = []
    for step, batch in enumerate(batches):
        for group in optimizer.param_groups:
            group["lr"] = SCHEDULES.get(tc.schedule)(step, lr=tc.lr, min_lr=tc.min_lr, warmup=tc.warmup_steps,
                                                     total=5, d_model=8)
        total = 0.0
        for micro in zip(*(np.array_split(a, 2) for a in batch)):
            src, src_mask, tgt, tgt_mask, labels = (torch.from_numpy(a) for a in micro)
            logits = model(src, tgt, src_mask, tgt_mask)
            loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100) / 2
            loss.backward()
            total += loss.item()
        torch.nn.utils.clip_grad_norm_(model.parameters(), tc.grad_clip)
        optimizer.step()
        optimizer.zero_grad()
        expected.append(total)
    np.testing.assert_allclose(losses, expected, rtol=0, atol=1e-10)
    final = to_numpy(model)
    assert max(np.abs(final[n] - params[n]).max() for n in params) < 1e-9


def test_muon_matches_the_torch_engines_muon_for_six_steps():
    """The NumPy Muon (hidden matrices) + AdamW (the rest) against qkv.train.muon in float64, through a
    changing rate applied as the Trainer applies it (each group's lr_scale)."""
    from qkv.train.muon import muon

    torch.manual_seed(0)
    cfg = qkv.ModelConfig(vocab_size=20, d_model=8, n_heads=2, n_layers=2, d_ff=24, max_seq_len=8)
    model = qkv.build_model(cfg).double()
    tc = TrainConfig(optimizer="muon", lr=0.01, muon_lr=0.05, muon_momentum=0.9, weight_decay=0.1)
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
