"""The training loop: clipping, accumulation == one large batch (SPEC B1, B4, B5, claim 21),
non-finite steps, and save/resume in the middle of a cosine schedule."""
import dataclasses
import json
import math
import os
import signal

import numpy as np
import pytest
import torch

from qkv import presets
from qkv.data.dataset import Prepared
from qkv.errors import QkvError
from qkv.train.loop import Trainer
from qkv.train.metrics import MetricsLog

VOCAB = 64


def tokens(n: int = 3000, seed: int = 0) -> np.ndarray:
    """A stream with some structure (a noisy counter), so the loss moves."""
    rng = np.random.default_rng(seed)
    return ((np.arange(n) * 7 + rng.integers(0, 3, n)) % VOCAB).astype(np.uint16)


def data() -> Prepared:
    return Prepared(tokenizer=None, train=tokens(), val=tokens(800, seed=1), val_chars=800, cache_dir=None)


def run_config(**train):
    cfg = presets.get("tiny")
    base = dict(device="cpu", threads=1, log_every=1, eval_batches=1)
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, vocab_size=VOCAB),
                               train=dataclasses.replace(cfg.train, **{**base, **train}))


def trainer(tmp_path, name="run", **train) -> Trainer:
    path = tmp_path / name
    path.mkdir()
    return Trainer(path, run_config(**train), data(), progress=False, log=lambda message: None)


def params(t: Trainer) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in t.model.named_parameters()}


def capture_grads(t: Trainer) -> list[dict[str, torch.Tensor]]:
    """The gradients the optimizer sees at each step (after accumulation and clipping)."""
    seen = []
    t.optimizer.register_step_pre_hook(
        lambda opt, args, kwargs: seen.append({n: p.grad.clone() for n, p in t.model.named_parameters()}))
    return seen


@pytest.mark.parametrize("optimizer, clip", [("sgd", 0.0), ("sgd", 0.05), ("adamw", 0.0)])
def test_accumulation_equals_one_large_batch(tmp_path, optimizer, clip):
    """train.accumulation=4 over micro-batches of 2 == one batch of 8: gradients and the next weights."""
    settings = dict(grad_clip=clip, optimizer=optimizer, lr=0.1)
    one, four = trainer(tmp_path, "a1", **settings), trainer(tmp_path, "a4", accumulation=4, **settings)
    for a, b in zip(params(one).values(), params(four).values()):
        assert torch.equal(a, b)  # same seed, same initial weights
    g1, g4 = capture_grads(one), capture_grads(four)
    for step in range(3 if optimizer == "sgd" else 1):
        x, y = (torch.from_numpy(a) for a in one.batches.next())
        l1, n1, *_ = one.step(x, y, lr=0.1)
        l4, n4, *_ = four.step(x, y, lr=0.1)
        assert l4 == pytest.approx(l1, rel=1e-6) and n4 == pytest.approx(n1, rel=1e-5)
        if clip:
            assert n1 > clip  # clipping is active: the step sees gradients of norm `clip`
            norm = torch.sqrt(sum((g.double() ** 2).sum() for g in g1[step].values()))
            assert norm.item() == pytest.approx(clip, rel=1e-5)
        for name, grad in g1[step].items():
            torch.testing.assert_close(g4[step][name], grad, rtol=1e-5, atol=1e-8, msg=name)
        p1, p4 = params(one), params(four)
        for name in p1:
            # Adam divides by |g| + eps: where |g| is near eps (e.g. the key bias, whose exact gradient is 0)
            # fp32 rounding noise in g becomes a visible step, so only coordinates with |g| >> eps compare
            keep = g1[step][name].abs() > 1e-5 if optimizer == "adamw" else torch.ones_like(p1[name], dtype=bool)
            torch.testing.assert_close(p4[name][keep], p1[name][keep], rtol=1e-5, atol=1e-7, msg=name)


def test_grad_norm_is_global_l2_norm_before_clipping(tmp_path):
    t = trainer(tmp_path, grad_clip=0.0)
    seen = capture_grads(t)
    x, y = (torch.from_numpy(a) for a in t.batches.next())
    norm = t.step(x, y, lr=1e-3).grad_norm
    expected = math.sqrt(sum((g.double() ** 2).sum().item() for g in seen[0].values()))
    assert norm == pytest.approx(expected, rel=1e-5)


def test_non_finite_steps_are_skipped_logged_then_stop(tmp_path):
    """NaN in a weight: every step is skipped (weights and moments untouched), logged in metrics.csv with a
    running `skipped` count, and after train.max_bad_steps in a row the run stops with QkvError."""
    t = trainer(tmp_path, max_steps=20, max_bad_steps=3, checkpoint_every=2, log_every=5)

    def poison(module, args):  # checkpoints at steps 2 and 4, then a NaN weight from the forward of step 5 on
        if t.state.step == 4:
            with torch.no_grad():
                t.model.final_norm.weight[0] = float("nan")
    t.model.register_forward_pre_hook(poison)
    with pytest.raises(QkvError, match=r"3 non-finite steps in a row \(steps 5-7\).*checkpoint at step 4 is kept"):
        t.run()
    rows = MetricsLog.read(tmp_path / "run" / "metrics.csv")
    assert [(r["step"], r["skipped"]) for r in rows] == [("5", "1"), ("6", "2"), ("7", "3")]  # log_every=5
    assert t.state.skipped == 3 and t.state.step == 7
    saved = Trainer(tmp_path / "run", run_config(), data(), progress=False, log=lambda m: None)
    assert saved.resume() and saved.state.step == 4  # the last good checkpoint, untouched
    assert all(torch.isfinite(p).all() for p in saved.model.parameters())


def test_a_skipped_step_changes_nothing(tmp_path):
    t = trainer(tmp_path)
    x, y = (torch.from_numpy(a) for a in t.batches.next())
    t.step(x, y, lr=1e-2)  # Adam moments exist
    moments = {k: v.clone() for state in t.optimizer.state.values() for k, v in state.items() if k != "step"}
    with torch.no_grad():
        t.model.final_norm.weight[0] = float("nan")
    before = params(t)
    result = t.step(x, y, lr=1e-2)
    assert result.skipped and math.isnan(result.loss) and t.state.skipped == 1 and t.state.bad_steps == 1
    for name, p in before.items():
        assert torch.equal(params(t)[name], p) or name == "final_norm.weight"
    after = {k: v for state in t.optimizer.state.values() for k, v in state.items() if k != "step"}
    assert all(torch.equal(after[k], v) for k, v in moments.items())


def test_lr_column_follows_the_schedule_to_min_lr(tmp_path):
    t = trainer(tmp_path, max_steps=9, warmup_steps=3)
    t.run()
    rows = [r for r in MetricsLog.read(tmp_path / "run" / "metrics.csv") if r["loss"]]
    lrs = [float(r["lr"]) for r in rows]
    assert [int(r["step"]) for r in rows] == list(range(1, 10))
    tc = t.tc
    assert lrs[:3] == pytest.approx([tc.lr / 3, 2 * tc.lr / 3, tc.lr], rel=1e-5)
    assert lrs[3] == pytest.approx(tc.lr, rel=1e-5)
    assert lrs[-1] == pytest.approx(tc.min_lr, rel=1e-5)


def interrupt_during(t: Trainer, step: int) -> None:
    """Send SIGINT to this process inside optimizer.step of update `step` (1-based): mid-step."""
    def hook(opt, args, kwargs):
        if t.state.step == step - 1:
            os.kill(os.getpid(), signal.SIGINT)
    t.optimizer.register_step_pre_hook(hook)


def test_sigint_mid_step_finishes_the_step_saves_and_resumes_bit_identically(tmp_path):
    """Ctrl-C inside update 5: the update completes, the checkpoint is at step 5 (not a half-updated 4),
    KeyboardInterrupt propagates (exit 130 in the CLI), and a resume reproduces the uninterrupted run."""
    settings = dict(max_steps=10, warmup_steps=2, checkpoint_every=0)
    whole = trainer(tmp_path, "whole", **settings)
    whole.run()
    messages = []
    first = Trainer(tmp_path / "whole", run_config(**settings), data(), progress=False, log=messages.append)
    first.run_dir = tmp_path / "split"
    first.run_dir.mkdir()
    interrupt_during(first, 5)
    handler_before = signal.getsignal(signal.SIGINT)  # default_int_handler, or SIG_IGN in a background job
    with pytest.raises(KeyboardInterrupt):
        first.run()
    assert first.saved_step == 5 and any("finishing this step" in m for m in messages)
    assert signal.getsignal(signal.SIGINT) is handler_before  # the handler is restored
    second = Trainer(tmp_path / "split", run_config(**settings), data(), progress=False, log=lambda m: None)
    assert second.resume() and second.state.step == 5 and second.state.horizon == 10
    second.run()
    for name, p in params(whole).items():
        assert torch.equal(params(second)[name], p), name
    rows = {name: [(r["step"], r["loss"], r["lr"]) for r in MetricsLog.read(tmp_path / name / "metrics.csv")
                   if r["loss"] and int(r["step"]) > 5] for name in ("whole", "split")}
    assert rows["split"] == rows["whole"] and len(rows["whole"]) == 5


def test_second_sigint_stops_at_once_without_saving(tmp_path):
    t = trainer(tmp_path, max_steps=10, checkpoint_every=2)

    def hook(opt, args, kwargs):
        if t.state.step == 4:  # inside update 5: two interrupts
            os.kill(os.getpid(), signal.SIGINT)
            os.kill(os.getpid(), signal.SIGINT)
    t.optimizer.register_step_pre_hook(hook)
    with pytest.raises(KeyboardInterrupt):
        t.run()
    assert t.saved_step == 4 and t.state.step == 4  # stopped inside update 5; checkpoint 4 untouched
    assert json.loads((tmp_path / "run" / "train_state.json").read_text())["step"] == 4


def test_resume_with_more_steps_extends_the_run(tmp_path):
    first = trainer(tmp_path, max_steps=3)
    first.run()
    longer = Trainer(tmp_path / "run", run_config(max_steps=6), data(), progress=False, log=lambda m: None)
    assert longer.resume() and longer.state.horizon == 6
    assert longer.run()["steps"] == 6
