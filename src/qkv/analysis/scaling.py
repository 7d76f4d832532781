"""Scaling laws: the power-law fit L(N) = a / N^b + c (note 000 LLM §8.2) and the Chinchilla
compute-optimal split of a FLOP budget (Hoffmann et al. 2022, approach 3; SPEC F3, claim 25).

The fit needs no scipy: for a fixed exponent b the model is linear in (a, c), so least squares gives
them in closed form, and b is found by a grid search refined with golden-section steps on the residual
(variable projection). Note 000 §8.2 writes N for training tokens; the same law is used over parameters
(Kaplan et al. 2020), so `fit_power_law` takes whichever x it is given.

Chinchilla's parametric loss L(N, D) = E + A / N^alpha + B / D^beta, minimised under C = 6 N D, gives
    N_opt = G (C/6)^(beta / (alpha + beta)),  D_opt = (C/6) / N_opt,  G = (alpha A / (beta B))^(1 / (alpha + beta)).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from qkv.errors import QkvError
from qkv.analysis import params, plots
from qkv.analysis.plots import read_metrics
from qkv.config import RunConfig

GOLDEN = (math.sqrt(5) - 1) / 2


@dataclass(frozen=True)
class PowerLaw:
    a: float
    b: float
    c: float
    rmse: float  # root mean square residual of the fit

    def __call__(self, n):
        return self.a / np.power(n, self.b) + self.c

    def as_dict(self) -> dict:
        return asdict(self)


def _solve_linear(x: np.ndarray, y: np.ndarray, b: float) -> tuple[float, float, float]:
    """Least-squares (a, c) for y = a x^-b + c, and the sum of squared residuals."""
    design = np.stack([np.power(x, -b), np.ones_like(x)], axis=1)  # (n, 2)
    (a, c), *_ = np.linalg.lstsq(design, y, rcond=None)
    residual = y - design @ np.array([a, c])
    return float(a), float(c), float(residual @ residual)


def fit_power_law(x, y, b_range: tuple[float, float] = (1e-3, 3.0)) -> PowerLaw:
    """Fit y = a / x^b + c by variable projection: a grid over b, then golden-section refinement."""
    x, y = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
    if x.shape != y.shape or x.size < 3:
        raise QkvError(f"a power-law fit needs at least 3 points, got {x.size}")
    if np.any(x <= 0) or not np.all(np.isfinite(y)):
        raise QkvError("a power-law fit needs positive x and finite losses")
    if np.unique(x).size < 3:
        raise QkvError("a power-law fit needs at least 3 distinct x values")
    scale = float(np.exp(np.log(x).mean()))  # fit on x / scale, so x^-b stays well conditioned
    xs = x / scale
    grid = np.linspace(*b_range, 300)
    sse = [_solve_linear(xs, y, b)[2] for b in grid]
    i = int(np.argmin(sse))
    lo, hi = grid[max(0, i - 1)], grid[min(len(grid) - 1, i + 1)]
    for _ in range(60):  # golden-section search on [lo, hi]
        m1, m2 = hi - GOLDEN * (hi - lo), lo + GOLDEN * (hi - lo)
        if _solve_linear(xs, y, m1)[2] < _solve_linear(xs, y, m2)[2]:
            hi = m2
        else:
            lo = m1
    b = (lo + hi) / 2
    a, c, err = _solve_linear(xs, y, b)
    return PowerLaw(a=float(a * scale ** b), b=float(b), c=float(c), rmse=math.sqrt(err / x.size))


@dataclass(frozen=True)
class ChinchillaFit:
    """L(N, D) = E + A / N^alpha + B / D^beta."""

    name: str
    E: float
    A: float
    B: float
    alpha: float
    beta: float
    source: str

    def loss(self, n_params: float, tokens: float) -> float:
        return self.E + self.A / n_params ** self.alpha + self.B / tokens ** self.beta

    def optimal(self, flops: float) -> dict:
        """The compute-optimal parameters and tokens for a budget of `flops` (C = 6 N D)."""
        if not flops > 0:
            raise QkvError(f"budget={flops} FLOPs must be positive")
        s = self.alpha + self.beta
        G = (self.alpha * self.A / (self.beta * self.B)) ** (1 / s)
        n_opt = G * (flops / 6) ** (self.beta / s)
        d_opt = flops / (6 * n_opt)
        return {"fit": self.name, "flops": flops, "params": n_opt, "tokens": d_opt,
                "tokens_per_param": d_opt / n_opt, "loss": self.loss(n_opt, d_opt)}


FITS = {
    "hoffmann": ChinchillaFit("hoffmann", E=1.69, A=406.4, B=410.7, alpha=0.34, beta=0.28,
                              source="Hoffmann et al. 2022, approach 3 (eq. 10), as published"),
    "besiroglu": ChinchillaFit("besiroglu", E=1.8172, A=482.01, B=2085.43, alpha=0.3478, beta=0.3658,
                               source="Besiroglu et al. 2024, 'Chinchilla scaling: a replication attempt', "
                                      "refit of approach 3 on the paper's own data"),
}


def chinchilla(flops: float, fit: str = "hoffmann") -> dict:
    if fit not in FITS:
        raise QkvError(f"fit={fit!r} is not allowed; choose from: {', '.join(FITS)}")
    return FITS[fit].optimal(flops)


# ---- `qkv scaling RUN...` ------------------------------------------------------------------------

def _run_points(run: Path, x: str) -> tuple[np.ndarray, np.ndarray]:
    """(x, loss) of one run: its non-embedding parameters and last validation loss (x = params), or
    tokens seen and training loss after warmup (x = tokens)."""
    config_file = Path(run) / "config.json"
    if not config_file.is_file():
        raise QkvError(f"{run}: not a qkv run (no config.json)")
    cfg = RunConfig.load(config_file)
    m = read_metrics(run)
    if x == "params":
        val = m["val_loss"][~np.isnan(m["val_loss"])]
        if not val.size:
            raise QkvError(f"{run}: metrics.csv has no validation loss")
        return np.array([params.breakdown(cfg.model)["non_embedding"]], dtype=float), val[-1:]
    keep = ~np.isnan(m["loss"]) & (m["step"] > cfg.train.warmup_steps)
    return m["step"][keep] * cfg.train.batch_size * cfg.train.seq_len, m["loss"][keep]


def analyse(runs: list[Path], *, x: str, budget: float | None, fit: str, out: Path) -> dict:
    """Fit L = a / x^b + c over the runs (one fit for x = params, one per run for x = tokens), plot it,
    and give the compute-optimal split of `budget` under both Chinchilla fits."""
    result: dict = {"x": x, "fits": []}
    if runs:
        points = [_run_points(run, x) for run in runs]
        groups = [("all runs", np.concatenate([p[0] for p in points]), np.concatenate([p[1] for p in points]))]
        if x == "tokens":
            groups = [(str(run), *p) for run, p in zip(runs, points)]
        for name, xs, ys in groups:
            law = fit_power_law(xs, ys)
            result["fits"].append({"runs": name, "points": int(xs.size), **law.as_dict()})
        xs, ys = groups[0][1], groups[0][2]
        result["plot"] = str(plots.scaling_fit(xs, ys, fit_power_law(xs, ys), out,
                                               xlabel="non-embedding parameters N" if x == "params" else "tokens"))
    if budget is not None:
        result["chinchilla"] = chinchilla(budget, fit)
        result["chinchilla_other_fits"] = [FITS[name].optimal(budget) for name in FITS if name != fit]
    return result
