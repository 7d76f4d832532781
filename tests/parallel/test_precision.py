"""Mixed precision (SPEC B6; note 000 LLM §6.2): fp16 dynamic loss scaling on an injected overflow, fp32
master weights, and softmax / norms / loss in fp32 under bf16 autocast (CPU)."""
import dataclasses
import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from qkv.models import build_model
from qkv.parallel.precision import autocast
from qkv.train.metrics import MetricsLog
from tests.train.test_loop import params, trainer

INIT_SCALE = 2.0 ** 16  # torch.amp.GradScaler's initial scale


def inject_overflow(t, when) -> None:
    """Make one gradient element inf during the backward of the steps for which `when(step)` holds."""
    weight = t.model.blocks[0].ffn.up_proj.weight

    def hook(grad):
        if when(t.state.step):
            grad = grad.clone()
            grad.view(-1)[0] = math.inf
        return grad
    weight.register_hook(hook)


def test_fp16_overflow_skips_the_update_and_halves_the_scale_then_grows(tmp_path):
    t = trainer(tmp_path, precision="fp16", loss_scale_window=2)
    inject_overflow(t, lambda step: step == 2)
    x, y = (torch.from_numpy(a) for a in t.batches.next())
    scales, skipped = [], []
    for _ in range(5):
        before = params(t)
        result = t.step(x, y, lr=1e-2)
        t.state.step += 1
        changed = any(not torch.equal(params(t)[n], p) for n, p in before.items())
        assert changed != result.skipped  # an update, or none at all
        scales.append(t.scaler.get_scale())
        skipped.append(result.skipped)
    assert skipped == [False, False, True, False, False]
    # two good steps double S; the overflow halves it; two more good steps double it again
    assert scales == [INIT_SCALE, 2 * INIT_SCALE, INIT_SCALE, INIT_SCALE, 2 * INIT_SCALE]
    assert t.state.skipped == 1 and t.state.bad_steps == 0


def test_fp16_overflow_is_logged_in_metrics_and_the_run_goes_on(tmp_path):
    messages = []
    t = trainer(tmp_path, precision="fp16", max_steps=6, log_every=3)
    t.log = messages.append
    inject_overflow(t, lambda step: step == 1)  # the second update
    summary = t.run()
    rows = [r for r in MetricsLog.read(tmp_path / "run" / "metrics.csv") if r["loss"]]
    assert [(r["step"], r["skipped"], float(r["loss_scale"])) for r in rows] == [
        ("2", "1", INIT_SCALE / 2), ("3", "1", INIT_SCALE / 2), ("6", "1", INIT_SCALE / 2)]
    assert summary["skipped_steps"] == 1 and summary["steps"] == 6 and math.isfinite(summary["val_loss"])
    assert any("step 2: non-finite" in m and "loss scale now 32768" in m for m in messages)


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_master_weights_grads_and_moments_stay_fp32(tmp_path, precision):
    t = trainer(tmp_path, precision=precision)
    grad_dtypes, matmul_dtypes = set(), set()
    t.optimizer.register_step_pre_hook(
        lambda opt, args, kwargs: grad_dtypes.update(p.grad.dtype for p in t.model.parameters()))
    t.model.lm_head.register_forward_hook(lambda module, args, out: matmul_dtypes.add(out.dtype))
    x, y = (torch.from_numpy(a) for a in t.batches.next())
    for _ in range(2):
        assert not t.step(x, y, lr=1e-3).skipped
    low = torch.float16 if precision == "fp16" else torch.bfloat16
    assert matmul_dtypes == {low}  # autocast ran the matmuls in low precision...
    assert {p.dtype for p in t.model.parameters()} == {torch.float32}  # ...on fp32 master weights
    assert grad_dtypes == {torch.float32}
    moments = {v.dtype for state in t.optimizer.state.values() for k, v in state.items() if k != "step"}
    assert moments == {torch.float32}


class OpDtypes(TorchDispatchMode):
    """Every aten op that runs (after autocast has cast its inputs) with its tensor inputs' dtypes."""

    def __init__(self):
        super().__init__()
        self.ops: list[tuple[str, list[torch.dtype]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append((func.__name__, [a.dtype for a in args if isinstance(a, torch.Tensor)]))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("norm", ["layernorm", "rmsnorm"])
def test_softmax_norms_and_loss_compute_in_fp32_under_bf16_autocast(tmp_path, norm):
    """The naive kernel forms the softmax explicitly (the fused sdpa kernel accumulates in fp32 inside);
    F.rms_norm decomposes on the CPU, so its rsqrt(mean(x^2) + eps) stands for the norm. The head and its loss
    run in row chunks (qkv.nn.linear_cross_entropy): the loss is each chunk's max, exp and log of the sum."""
    t = trainer(tmp_path)
    model = build_model(dataclasses.replace(t.cfg.model, attention="naive", norm=norm))
    x, y = (torch.from_numpy(a) for a in t.batches.next())
    with autocast(torch.device("cpu"), "bf16"), OpDtypes() as recorder:
        t.objective.loss(model, (x, y), 0.0)
    by_kind = {"softmax": [], "norm": [], "loss": [], "matmul": []}
    for name, dtypes in recorder.ops:
        base = name.split(".")[0]
        kind = ("softmax" if base == "_softmax" else "loss" if base in ("amax", "exp_", "log")
                else "norm" if "norm" in base or base == "rsqrt" else "matmul" if base in ("mm", "addmm", "bmm") else None)
        if kind:
            by_kind[kind].append(dtypes[0])
    assert by_kind["softmax"] and set(by_kind["softmax"]) == {torch.float32}  # one per layer
    assert len(by_kind["norm"]) >= 5 and set(by_kind["norm"]) == {torch.float32}  # 2 per layer + final
    assert len(by_kind["loss"]) >= 3 and set(by_kind["loss"]) == {torch.float32}
    assert by_kind["matmul"] and set(by_kind["matmul"]) == {torch.bfloat16}
