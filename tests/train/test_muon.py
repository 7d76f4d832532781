"""Muon (qkv.train.muon): the Newton-Schulz iteration against an SVD (it keeps the singular vectors and maps
each singular value through the scalar quintic), the update rule against a hand-computed step, which
parameters it takes, its checkpoint round trip, and the refusal under sharding."""
import copy

import numpy as np
import pytest
import torch

import qkv
from qkv import hardware
from qkv.train.checks import check_run
from qkv.config import RunConfig, TrainConfig, ParallelConfig
from qkv.errors import QkvError
from qkv.ref.optim import NS_ITERATIONS
from qkv.train.muon import MuonAdamW, hidden_matrices, muon, newton_schulz, orthogonalised
from qkv.train.loop import Trainer
from qkv.train.optim import OPTIMIZERS
from tests.train.test_loop import data, run_config


def scalar_iteration(x: np.ndarray, iteration: str = "jordan") -> np.ndarray:
    """The iteration's five scalar quintics p_k(x) = a_k x + b_k x^3 + c_k x^5 on x = sigma / ||U||_F (the
    safety factor s divides first)."""
    steps, safety = NS_ITERATIONS.get(iteration)
    x = x / safety
    for a, b, c in steps:
        x = a * x + b * x ** 3 + c * x ** 5
    return x


# (iteration, the band its five steps put the singular values in, for inputs sigma / ||U||_F in [1e-2, 1])
BANDS = {"jordan": (0.6, 1.25), "polar_express": (0.85, 1.15)}


@pytest.mark.parametrize("iteration", sorted(BANDS))
@pytest.mark.parametrize("shape", [(16, 16), (8, 32), (48, 12)])
def test_newton_schulz_is_the_scalar_iteration_on_the_singular_values(shape, iteration):
    torch.manual_seed(0)
    g = torch.randn(*shape, dtype=torch.float64)
    u, s, vh = torch.linalg.svd(g, full_matrices=False)
    x = scalar_iteration((s / torch.linalg.norm(g)).numpy(), iteration)
    expected = u @ torch.diag(torch.from_numpy(x)) @ vh
    out = newton_schulz(g, iteration=iteration).double()
    assert torch.allclose(out, expected, atol=2e-5), float((out - expected).abs().max())
    polar = u @ vh  # the orthogonal polar factor: five steps land every singular value near 1, not at it
    sv = torch.linalg.svdvals(out)
    low, high = BANDS[iteration]
    assert float(sv.min()) > low and float(sv.max()) < high
    cos = float((out * polar).sum() / (out.norm() * polar.norm()))
    assert cos > 0.97


def test_polar_express_lands_closer_to_one_than_jordans_quintic():
    """Amsel et al. 2025's claim, on the scalar maps: over sigma / ||U||_F in [1e-3, 1] the five minimax steps
    stay within [0.84, 1.15] (Jordan's within [0.47, 1.21]), about half as far from 1 on average."""
    x = np.linspace(1e-3, 1.0, 20_001)
    polar, jordan = scalar_iteration(x, "polar_express"), scalar_iteration(x, "jordan")
    assert 0.84 < polar.min() and polar.max() < 1.15
    assert 0.47 < jordan.min() < 0.5 and 1.18 < jordan.max() < 1.21
    assert np.abs(1 - polar).mean() < 0.55 * np.abs(1 - jordan).mean()


def test_muon_iteration_is_checked_and_applies_to_muon_only():
    tc = TrainConfig(optimizer="muon", muon_iteration="polar_express")
    opt = OPTIMIZERS.get("muon")(qkv.build_model(qkv.ModelConfig(vocab_size=16, d_model=8, n_heads=2, n_layers=1,
                                                                 d_ff=16, max_seq_len=8)), tc)
    assert opt.iteration == "polar_express"
    bad = RunConfig(train=TrainConfig(optimizer="muon", muon_iteration="cubic"))
    choices = "train.muon_iteration='cubic' is not allowed; choose from: jordan, polar_express"
    with pytest.raises(QkvError, match=choices):
        check_run(bad)
    refusal = (r"train.muon_iteration='polar_express' applies to train.optimizer='muon' \(its Newton-Schulz "
               r"iteration\), not 'adamw': --set train.muon_iteration=jordan to run without it")
    with pytest.raises(QkvError, match=refusal):
        check_run(RunConfig(train=TrainConfig(optimizer="adamw", muon_iteration="polar_express")))
    check_run(RunConfig(train=TrainConfig(optimizer="adamw")))  # the default is never refused


def test_orthogonalised_batches_by_shape_and_equals_each_matrix_alone():
    torch.manual_seed(0)
    updates = [torch.randn(*shape) for shape in [(16, 16), (48, 12), (16, 16), (12, 48), (48, 12), (16, 16)]]
    for iteration in BANDS:
        out = orthogonalised(updates, iteration=iteration)
        for u, o in zip(updates, out):
            assert o.shape == u.shape
            alone = newton_schulz(u, iteration=iteration)
            assert torch.allclose(o, alone, atol=1e-6), float((o - alone).abs().max())
            # and each against the SVD form of the scalar iteration, in float64
            g = u.double()
            uu, s, vh = torch.linalg.svd(g, full_matrices=False)
            x = scalar_iteration((s / torch.linalg.norm(g)).numpy(), iteration)
            assert torch.allclose(o.double(), uu @ torch.diag(torch.from_numpy(x)) @ vh, atol=2e-5)


@pytest.mark.parametrize("iteration, bound", [("jordan", 0.05), ("polar_express", 0.08)])
@pytest.mark.parametrize("shape", [(128, 128), (128, 512), (512, 128)])
def test_newton_schulz_in_bf16_stays_within_bf16_rounding_of_the_scalar_iteration(shape, iteration, bound):
    """A bf16 run iterates in bf16 (the default job's shapes): the same singular vectors and the same scalar
    quintics on the singular values, up to bf16's rounding (unit roundoff 2^-8, amplified by the 5 steps: the
    relative error is about 2.5% with Jordan's quintic, bounded here by 5%; about 3.5-5.6% with Polar Express,
    whose first step's larger coefficients (8.2, -22.5, 15.9) amplify it more, bounded by 8%), returned in
    U's fp32."""
    torch.manual_seed(0)
    g = torch.randn(*shape)
    out = newton_schulz(g, dtype=torch.bfloat16, iteration=iteration)
    assert out.dtype == torch.float32
    u, s, vh = torch.linalg.svd(g.double(), full_matrices=False)
    x = scalar_iteration((s / torch.linalg.norm(g.double())).numpy(), iteration)
    expected = u @ torch.diag(torch.from_numpy(x)) @ vh
    error = float((out.double() - expected).norm() / expected.norm())
    assert 2 ** -9 < error < bound, error  # above zero: the products really ran in bf16
    fp32 = newton_schulz(g, iteration=iteration).double()
    assert float((fp32 - expected).norm() / expected.norm()) < 1e-5
    sv, sv32 = torch.linalg.svdvals(out.double()), torch.linalg.svdvals(fp32)
    assert float((sv - sv32).abs().max()) < 0.1  # the same map of the singular values, within bf16's rounding


@pytest.mark.parametrize("flag, dtype", [("avx512_bf16", torch.bfloat16), (None, None)])
def test_a_trainers_muon_iterates_in_the_precision_auto_resolved_to(tmp_path, monkeypatch, flag, dtype):
    """train.precision=auto is resolved before the optimizer is made: bf16 iterations on a CPU that multiplies
    bf16 natively, fp32 on one that would emulate it; nothing of it in the state dict."""
    monkeypatch.setattr(hardware, "native_bf16_cpu", lambda: flag)
    cfg = run_config(optimizer="muon", precision="auto")
    trainer = Trainer(tmp_path, cfg, data(), progress=False, log=lambda message: None)
    assert trainer.tc.precision == ("bf16" if flag else "fp32")
    assert trainer.optimizer.ns_dtype == dtype
    assert "ns_dtype" not in trainer.optimizer.state_dict()["param_groups"][0]


@pytest.mark.parametrize("precision, dtype", [("fp32", None), ("bf16", torch.bfloat16)])
def test_muon_step_equals_the_formula_and_adamw_takes_the_rest(precision, dtype):
    """The formula with NS5 in the run's precision (bf16 runs iterate in bf16)."""
    torch.manual_seed(0)
    cfg = qkv.ModelConfig(vocab_size=64, d_model=16, n_heads=2, n_layers=1, d_ff=32, max_seq_len=16)
    model = qkv.build_model(cfg)
    tc = TrainConfig(optimizer="muon", lr=1e-2, muon_lr=0.05, muon_momentum=0.9, weight_decay=0.1,
                     precision=precision)
    opt = OPTIMIZERS.get("muon")(model, tc)
    hidden = hidden_matrices(model)
    names = {name for name, p in model.named_parameters() if id(p) in hidden}
    assert names == {n for n, p in model.named_parameters() if p.dim() == 2 and n.startswith("blocks.")}
    assert "tok_emb.weight" not in names
    w = model.blocks[0].ffn.up_proj.weight  # (32, 16): tall, scale sqrt(2)
    before = w.detach().clone()
    emb = model.tok_emb.weight
    emb_before = emb.detach().clone()
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    g, ge = w.grad.clone(), emb.grad.clone()
    opt.step()
    buf = g  # first step: B = G; Nesterov U = G + mu B
    expected = before * (1 - 0.05 * 0.1) - 0.05 * np.sqrt(2.0) * newton_schulz(g + 0.9 * buf, dtype=dtype)
    assert torch.allclose(w.detach(), expected, atol=1e-6)
    if dtype is not None:  # and not the fp32 iteration's step: the bf16 products really ran
        fp32_step = before * (1 - 0.05 * 0.1) - 0.05 * np.sqrt(2.0) * newton_schulz(g + 0.9 * buf)
        assert float((w.detach() - fp32_step).abs().max()) > 1e-4
    m, v = 0.1 * ge, 0.05 * ge ** 2  # AdamW, betas (0.9, 0.95), bias-corrected at t = 1: m_hat = g, v_hat = g^2
    adam = emb_before * (1 - 1e-2 * 0.1) - 1e-2 * (m / 0.1) / ((v / 0.05).sqrt() + tc.eps)
    assert torch.allclose(emb.detach(), adam, atol=1e-6)


def test_state_dict_round_trip_continues_identically():
    torch.manual_seed(0)
    cfg = qkv.ModelConfig(vocab_size=64, d_model=16, n_heads=2, n_layers=1, d_ff=32, max_seq_len=16)
    tc = TrainConfig(optimizer="muon")
    a = qkv.build_model(cfg)
    b = qkv.build_model(cfg)
    b.load_state_dict(a.state_dict())
    opt_a = muon(a, tc)
    grads = [[torch.randn_like(p) for p in a.parameters()] for _ in range(3)]
    for p, gr in zip(a.parameters(), grads[0]):
        p.grad = gr.clone()
    opt_a.step()
    b.load_state_dict(a.state_dict())
    opt_b = muon(b, tc)
    opt_b.load_state_dict(copy.deepcopy(opt_a.state_dict()))  # as from a checkpoint file: no shared tensors
    for step in grads[1:]:
        for model, opt in ((a, opt_a), (b, opt_b)):
            for p, gr in zip(model.parameters(), step):
                p.grad = gr.clone()
            opt.step()
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert torch.equal(pa, pb)


def test_lr_scale_carries_muon_lr_through_the_schedule():
    model = qkv.build_model(qkv.ModelConfig(vocab_size=64, d_model=16, n_heads=2, n_layers=1, d_ff=32))
    opt = muon(model, TrainConfig(optimizer="muon", lr=2e-3, muon_lr=0.02))
    scales = [g.get("lr_scale", 1.0) for g in opt.param_groups]
    assert scales == pytest.approx([10.0, 1.0, 1.0]) and isinstance(opt, MuonAdamW)


@pytest.mark.parametrize("parallel", [ParallelConfig(dp=2, zero=2), ParallelConfig(tp=2)])
def test_sharded_layouts_are_refused(parallel):
    with pytest.raises(QkvError, match="train.optimizer=muon"):
        check_run(RunConfig(train=TrainConfig(optimizer="muon"), parallel=parallel))


def test_two_data_parallel_processes_train_like_one(tmp_path_factory, tmp_path, monkeypatch):
    """Under dp=2 the gradient is the global batch's (DDP) and every rank applies the same Muon update:
    `torchrun ... qkv train` ends at one process's validation loss."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    from tests.train import setup_env, torchrun

    text = setup_env(monkeypatch, tmp_path_factory)
    repo = Path(__file__).resolve().parents[2]
    args = ["-m", "qkv", "train", "--preset", "tiny", "--data", str(text), "--set", "train.optimizer=muon",
            "--max-steps", "6", "--no-sample", "--quiet", "--json"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}

    def final(cmd: list[str]) -> dict:
        proc = subprocess.run(cmd, cwd=repo, env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-2000:]
        return json.loads(proc.stdout.strip().splitlines()[-1])

    one = final([sys.executable, *args, "--out", str(tmp_path / "one")])
    two = json.loads(torchrun(2, [*args, "--set", "parallel.dp=2", "--out", str(tmp_path / "two")])
                     .stdout.strip().splitlines()[-1])
    assert two["val_loss"] == pytest.approx(one["val_loss"], rel=1e-5)
