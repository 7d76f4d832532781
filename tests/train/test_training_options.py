"""Training options of the loop: the MoE aux loss (SPEC B8), batch-size warmup and LR scaling (B9), loss
spikes, TensorBoard, and the summary as strict JSON."""
import dataclasses
import json
import math
import sys

import pytest
import torch

from qkv.nn.linear_cross_entropy import cross_entropy
from qkv.nn.moe import aux_loss
from qkv.train.loop import Trainer
from qkv.train.metrics import MetricsLog
from tests.train.test_loop import capture_grads, data, interrupt_during, params, run_config, trainer


def moe_trainer(tmp_path, **train) -> Trainer:
    cfg = run_config(**train)
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, moe_experts=4, moe_top_k=2))
    (tmp_path / "moe").mkdir()
    return Trainer(tmp_path / "moe", cfg, data(), progress=False, log=lambda m: None)


@pytest.mark.parametrize("accumulation", [1, 2])
def test_moe_aux_loss_is_added_with_its_weight(tmp_path, accumulation):
    """The step's gradient == autograd of mean over micro-batches of CE + alpha * aux (note 000 LLM §6.3)."""
    alpha = 0.5
    t = moe_trainer(tmp_path, aux_loss_weight=alpha, grad_clip=0.0, accumulation=accumulation)
    oracle = {name: p.detach().clone().requires_grad_() for name, p in t.model.named_parameters()}
    seen = capture_grads(t)
    x, y = (torch.from_numpy(a) for a in t.batches.next())
    result = t.step(x, y, lr=1e-3)
    model = t.model
    with torch.no_grad():  # the weights before the step
        for name, p in model.named_parameters():
            p.copy_(oracle[name])
    model.zero_grad()
    aux_values = []
    for xs, ys in zip(x.chunk(accumulation), y.chunk(accumulation)):
        ce = cross_entropy(model(xs), ys)
        aux = aux_loss(model)
        aux_values.append(aux.item())
        ((ce + alpha * aux) / accumulation).backward()
    assert result.aux_loss == pytest.approx(sum(aux_values) / accumulation, rel=1e-6)
    assert 0.9 < result.aux_loss  # E sum f_e P_e >= 1 at a uniform router, about 1 at init
    for name, p in model.named_parameters():
        torch.testing.assert_close(seen[0][name], p.grad, rtol=1e-5, atol=1e-7, msg=name)
    router = "blocks.0.ffn.router.weight"
    model.zero_grad()
    cross_entropy(model(x), y).backward()  # without the aux term the router gradient differs
    assert not torch.allclose(model.get_parameter(router).grad, seen[0][router], rtol=1e-3)


def assert_resumes_exactly(tmp_path, settings: dict, whole: Trainer, *, at: int) -> None:
    """A run of `settings` stopped by Ctrl-C at step `at` and resumed ends with `whole`'s weights, bit for bit."""
    split = trainer(tmp_path, "split", **settings)
    interrupt_during(split, at)
    with pytest.raises(KeyboardInterrupt):
        split.run()
    resumed = Trainer(tmp_path / "split", run_config(**settings), data(), progress=False, log=lambda m: None)
    assert resumed.resume() and resumed.state.step == at
    resumed.run()
    for name, p in params(whole).items():
        assert torch.equal(params(resumed)[name], p), name


def test_batch_warmup_uses_the_first_rows_and_resumes_exactly(tmp_path):
    """rows(s) = 2 + 6 s // 4: 2, 3, 5, 6, then 8; micro-batches of 2 rows; the first update's gradient is the
    gradient of the batch's first 2 rows; a Ctrl-C mid-ramp resumes bit-identically."""
    settings = dict(batch_warmup_steps=4, batch_warmup_start=2, accumulation=4, max_steps=7, grad_clip=0.0,
                    schedule="constant", warmup_steps=0)
    whole = trainer(tmp_path, "whole", **settings)
    probe = trainer(tmp_path, "probe", **settings)
    x, y = (torch.from_numpy(a[:2]) for a in probe.batches.next())
    cross_entropy(probe.model(x), y).backward()
    seen = capture_grads(whole)
    summary = whole.run()
    # fp32 sums in another order (the kernels' blocking follows the batch's shape and memory: 2.6e-8 on a bias
    # gradient of 1.4e-3 on an AVX2 EPYC; K's bias has a gradient of 0 but for such rounding), so to the scale of
    # the whole gradient
    scale = max(float(p.grad.abs().max()) for p in probe.model.parameters())
    for name, p in probe.model.named_parameters():
        torch.testing.assert_close(seen[0][name], p.grad, rtol=1e-5, atol=1e-6 * scale, msg=name)
    rows = [r for r in MetricsLog.read(tmp_path / "whole" / "metrics.csv") if r["loss"]]
    assert [int(r["batch_size"]) for r in rows] == [2, 3, 5, 6, 8, 8, 8]
    assert summary["tokens"] == (2 + 3 + 5 + 6 + 8 * 3) * 32
    assert_resumes_exactly(tmp_path, settings, whole, at=3)


def test_seq_warmup_uses_the_first_columns_and_resumes_exactly(tmp_path):
    """cols(s) = 8 (1 + 3 s // 4): 8, 8, 16, 24, then 32 (train.seq_len); the first update's gradient is the
    gradient of the batch's first 8 columns; tokens count rows x cols; a Ctrl-C mid-ramp resumes bit-identically."""
    settings = dict(seq_warmup_steps=4, seq_warmup_start=8, max_steps=6, grad_clip=0.0, schedule="constant",
                    warmup_steps=0)
    whole = trainer(tmp_path, "whole", **settings)
    probe = trainer(tmp_path, "probe", **settings)
    x, y = (torch.from_numpy(a[:, :8]) for a in probe.batches.next())
    cross_entropy(probe.model(x), y).backward()
    seen = capture_grads(whole)
    summary = whole.run()
    # fp32 sums in another order (the kernels' blocking follows the batch's shape and memory: 2.6e-8 on a bias
    # gradient of 1.4e-3 on an AVX2 EPYC; K's bias has a gradient of 0 but for such rounding), so to the scale of
    # the whole gradient
    scale = max(float(p.grad.abs().max()) for p in probe.model.parameters())
    for name, p in probe.model.named_parameters():
        torch.testing.assert_close(seen[0][name], p.grad, rtol=1e-5, atol=1e-6 * scale, msg=name)
    rows = [r for r in MetricsLog.read(tmp_path / "whole" / "metrics.csv") if r["loss"]]
    assert [int(r["seq_len"]) for r in rows] == [8, 8, 16, 24, 32, 32]
    assert summary["tokens"] == (8 + 8 + 16 + 24 + 32 + 32) * whole.tc.batch_size
    assert_resumes_exactly(tmp_path, settings, whole, at=2)


def test_seq_warmup_is_refused_where_batches_are_not_position_wise():
    from qkv.config import RunConfig
    from qkv.errors import QkvError
    from qkv.train import objectives
    seq2seq = RunConfig().override(["model.arch=encoder-decoder", "train.seq_warmup_steps=10"])
    with pytest.raises(QkvError, match=r"train.seq_warmup_steps=10: train.objective='seq2seq' .* needs lm or mlm"):
        objectives.for_run(seq2seq)
    assert objectives.for_run(RunConfig().override(["train.seq_warmup_steps=10"])).cuts_columns


def test_a_partial_batch_in_unequal_micro_batches_equals_one_pass(tmp_path):
    """3 rows in micro-batches of 2 and 1, weighted 2/3 and 1/3, == the 3 rows at once."""
    one, four = trainer(tmp_path, "one", grad_clip=0.0), trainer(tmp_path, "four", accumulation=4, grad_clip=0.0)
    g1, g4 = capture_grads(one), capture_grads(four)
    x, y = (torch.from_numpy(a[:3]) for a in one.batches.next())
    assert one.step(x, y, lr=1e-3).loss == pytest.approx(four.step(x, y, lr=1e-3).loss, rel=1e-6)
    for name, grad in g1[0].items():
        torch.testing.assert_close(g4[0][name], grad, rtol=1e-5, atol=1e-8, msg=name)


def test_linear_lr_scaling_follows_the_rows_in_use(tmp_path):
    """lr_eff = lr * rows / base_batch (note 000 LLM §10.2), also during the batch ramp."""
    t = trainer(tmp_path, lr_scaling="linear", base_batch=4, schedule="constant", warmup_steps=0, max_steps=4,
                batch_warmup_steps=2, batch_warmup_start=4)
    t.run()
    rows = [r for r in MetricsLog.read(tmp_path / "run" / "metrics.csv") if r["loss"]]
    assert [int(r["batch_size"]) for r in rows] == [4, 6, 8, 8]
    assert [float(r["lr"]) for r in rows] == pytest.approx([t.tc.lr * b / 4 for b in (4, 6, 8, 8)], rel=1e-5)
    sqrt = trainer(tmp_path, "sqrt", lr_scaling="sqrt", base_batch=2, schedule="constant", warmup_steps=0)
    assert sqrt.lr(0) == pytest.approx(sqrt.tc.lr * 2.0, rel=1e-12)  # sqrt(8 / 2)


def test_a_loss_spike_is_reported_and_counted(tmp_path):
    messages = []
    t = trainer(tmp_path, max_steps=14, log_every=7, spike_factor=3.0)
    t.log = messages.append
    wrong = 100.0 * (torch.arange(64) % 7 == 0)  # large logits on a fixed few tokens: CE about 100 at step 12
    t.model.lm_head.register_forward_hook(lambda m, args, out: out + wrong if t.state.step == 11 else None)
    summary = t.run()
    assert summary["spikes"] == 1 and summary["skipped_steps"] == 0
    rows = [r for r in MetricsLog.read(tmp_path / "run" / "metrics.csv") if r["loss"]]
    assert [(r["step"], r["spikes"]) for r in rows] == [("7", "0"), ("12", "1"), ("14", "1")]
    assert sum("step 12: loss spike" in m for m in messages) == 1
    assert float(rows[1]["loss"]) > 3 * float(rows[0]["loss"])


def test_tensorboard_scalars_equal_metrics_csv(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    t = trainer(tmp_path, max_steps=4, tensorboard=True)
    t.run()
    events = EventAccumulator(str(tmp_path / "run" / "tensorboard"))
    events.Reload()
    rows = [r for r in MetricsLog.read(tmp_path / "run" / "metrics.csv") if r["loss"]]
    logged = [(e.step, e.value) for e in events.Scalars("loss")]
    assert [s for s, _ in logged] == [1, 2, 3, 4]
    assert [v for _, v in logged] == pytest.approx([float(r["loss"]) for r in rows], rel=1e-5)
    assert events.Scalars("val_loss")[-1].step == 4


def test_tensorboard_missing_is_one_warning(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import fails as without the package
    messages = []
    t = trainer(tmp_path, max_steps=2, tensorboard=True)
    t.log = messages.append
    t.run()
    warnings = [m for m in messages if "tensorboard" in m]
    assert len(warnings) == 1 and "\n" not in warnings[0] and "pip install tensorboard" in warnings[0]
    assert not (tmp_path / "run" / "tensorboard").exists()


def test_summary_with_a_nan_loss_is_strict_json(tmp_path):
    from qkv.cli.train import summary_line

    line = summary_line({"steps": 3, "val_loss": math.nan, "best_val_loss": math.inf, "spikes": 0})
    assert json.loads(line) == {"steps": 3, "val_loss": None, "best_val_loss": None, "spikes": 0}
    assert "NaN" not in line and "Infinity" not in line
