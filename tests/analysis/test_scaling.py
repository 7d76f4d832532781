"""Scaling (SPEC F3): the power-law fit recovers known laws; the Chinchilla split is the constrained optimum;
`qkv scaling` fits runs' metrics."""
import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from qkv.analysis import scaling
from qkv.config import ModelConfig, RunConfig, TrainConfig
from qkv.errors import QkvError
from tests.analysis import run_cli


@settings(max_examples=15, deadline=None)
@given(a=st.floats(10, 1000), b=st.floats(0.05, 1.0), c=st.floats(0.5, 3.0))
def test_fit_recovers_an_exact_power_law(a, b, c):
    x = np.geomspace(1e5, 1e9, 8)
    law = scaling.fit_power_law(x, a / x ** b + c)
    assert law.b == pytest.approx(b, rel=1e-3)
    assert law.c == pytest.approx(c, abs=1e-3 * (a / 1e9 ** b + c))
    assert law(x) == pytest.approx(a / x ** b + c, rel=1e-6)


def test_fit_with_noise_and_errors():
    x = np.geomspace(1e6, 1e9, 10)
    y = 400 / x ** 0.3 + 1.7 + np.random.default_rng(0).normal(0, 0.005, x.size)
    law = scaling.fit_power_law(x, y)
    assert law.b == pytest.approx(0.3, abs=0.03) and law.rmse < 0.01
    for bad in ((x[:2], y[:2]), (np.array([1.0, 1.0, 1.0]), y[:3]), (-x, y)):
        with pytest.raises(QkvError):
            scaling.fit_power_law(*bad)


@pytest.mark.parametrize("fit", list(scaling.FITS))
def test_chinchilla_split_is_the_constrained_minimum(fit):
    """N_opt minimises L(N, C / 6N) (Hoffmann et al. eq. 4): checked on a grid around it."""
    law, C = scaling.FITS[fit], 1e22
    best = scaling.chinchilla(C, fit)
    assert 6 * best["params"] * best["tokens"] == pytest.approx(C)
    grid = best["params"] * np.geomspace(0.5, 2.0, 41)
    losses = [law.loss(n, C / (6 * n)) for n in grid]
    assert abs(int(np.argmin(losses)) - 20) <= 1
    assert 15 < scaling.chinchilla(5.76e23, "besiroglu")["tokens_per_param"] < 25


def fake_run(path, d_model, n_layers, val_loss, points=()):
    """A run dir with config.json and metrics.csv (no weights: qkv scaling reads only these)."""
    path.mkdir()
    cfg = RunConfig(model=ModelConfig(d_model=d_model, n_heads=4, n_layers=n_layers, d_ff=4 * d_model),
                    train=TrainConfig(batch_size=4, seq_len=32, warmup_steps=2))
    cfg.save(path / "config.json")
    rows = ["step,loss,val_loss,lr,grad_norm,tokens_per_s,elapsed_s"]
    rows += [f"{step},{loss},,0.001,1.0,1000,1.0" for step, loss in points]
    rows += [f"{points[-1][0] if points else 10},,{val_loss},,,,2.0"]
    (path / "metrics.csv").write_text("\n".join(rows) + "\n")
    return path


def test_scaling_command_over_runs(tmp_path):
    from qkv.analysis import params

    runs = []
    for i, (d, layers) in enumerate([(32, 1), (64, 2), (128, 3), (256, 4)]):
        n = params.breakdown(ModelConfig(d_model=d, n_heads=4, n_layers=layers, d_ff=4 * d))["non_embedding"]
        runs.append(fake_run(tmp_path / f"run{i}", d, layers, 50 / n ** 0.25 + 1.5))
    rc, out, err = run_cli("scaling", *runs, "--budget", "1e20", "--out", tmp_path / "fit.png", "--json")
    assert rc == 0, err
    result = json.loads(out)
    assert result["fits"][0]["b"] == pytest.approx(0.25, rel=1e-3)
    assert result["fits"][0]["c"] == pytest.approx(1.5, abs=1e-3)
    assert (tmp_path / "fit.png").stat().st_size > 10_000
    assert {result["chinchilla"]["fit"], result["chinchilla_other_fits"][0]["fit"]} == set(scaling.FITS)
    rc, out, _ = run_cli("scaling", runs[0], "--x", "tokens", "--out", tmp_path / "t.png")
    assert rc == 2  # metrics.csv of run0 has no training rows to fit


def test_scaling_tokens_fits_one_runs_curve(tmp_path):
    steps = np.arange(3, 40)
    run = fake_run(tmp_path / "curve", 32, 1, 2.0, [(int(s), 30 / (s * 128) ** 0.4 + 2.0) for s in steps])
    rc, out, err = run_cli("scaling", run, "--x", "tokens", "--out", tmp_path / "t.png", "--json")
    assert rc == 0, err
    assert json.loads(out)["fits"][0]["b"] == pytest.approx(0.4, rel=1e-3)


def test_scaling_needs_input():
    rc, _, err = run_cli("scaling")
    assert rc == 2 and err.startswith("qkv: error:") and err.count("\n") == 1
