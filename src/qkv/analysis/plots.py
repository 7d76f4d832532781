"""Figures (SPEC F2): attention heat maps, positional encodings, loss and LR curves, gradient norms.

Each function takes data (or a config) and a PNG path, draws with matplotlib's Agg backend (no display
needed) and returns the path. The attention maps come from a recording kernel (qkv.analysis.record).
"""
from __future__ import annotations

import csv
import math
from pathlib import Path

import numpy as np

from qkv.errors import QkvError
from qkv.nn.positional import Rotary, sinusoidal_table
from qkv.schedules import SCHEDULES


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only: no display, no GUI toolkit
    import matplotlib.pyplot as plt

    return plt


def _save(fig, out: Path) -> Path:
    """Write the figure; a name without an extension gets .png (as matplotlib writes it): the path returned
    is the file written."""
    out = Path(out)
    if not out.suffix:
        out = out.with_suffix(".png")
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        fig.savefig(out, dpi=110, bbox_inches="tight")
    except ValueError as exc:  # an extension matplotlib has no writer for
        raise QkvError(f"{out}: {exc}") from None
    finally:
        _pyplot().close(fig)
    return out


# ---- attention (note 000 §14) ---------------------------------------------------------------------

def attention_grid(maps: list[np.ndarray], tokens: list[str], out: Path, names: list[str] | None = None) -> Path:
    """One heat map per layer (rows) and head (columns); maps[l] is (H, T, T), row = query, column = key."""
    plt = _pyplot()
    L, H = len(maps), maps[0].shape[0]
    T = len(tokens)
    cell = max(1.6, min(3.2, 0.16 * T))
    fig, axes = plt.subplots(L, H, figsize=(cell * H + 1, cell * L + 1), squeeze=False)
    labels = T <= 32
    for l, layer in enumerate(maps):
        for h in range(H):
            ax = axes[l][h]
            top = float(layer[h][1:].max()) if T > 1 else 1.0  # row 0 of a causal map is always [1, 0, ...]
            ax.imshow(layer[h], cmap="viridis", vmin=0.0, vmax=top, interpolation="nearest")
            ax.set_title(f"{names[l] if names else f'layer {l}'} head {h}", fontsize=7)
            ax.set_xticks(range(T) if labels else [])
            ax.set_yticks(range(T) if labels else [])
            if labels:
                ax.set_xticklabels(tokens, rotation=90, fontsize=5)
                ax.set_yticklabels(tokens, fontsize=5)
    fig.suptitle("attention weights A = softmax(QK^T/sqrt(d_k) + M): row = query, column = key "
                 "(each panel scaled to its largest weight below row 0)", fontsize=9)
    return _save(fig, out)


# ---- positional encodings (note 000 §3.1, §11; note 003) -------------------------------------------

def sinusoidal_pe(out: Path, *, d_model: int = 128, positions: int = 100, base: float = 10000.0) -> Path:
    """PE(pos, 2i) = sin(pos w_i), PE(pos, 2i+1) = cos(pos w_i) as a heat map, and w_i = base^(-2i/d) with
    its wavelength 2 pi / w_i (note 000 §11.2: low dimensions fast, high dimensions slow)."""
    import torch


    if d_model < 2 or positions < 1:
        raise QkvError(f"--d-model={d_model} must be at least 2 and --positions={positions} positive")
    table = sinusoidal_table(torch.arange(positions), d_model, base, dtype=torch.float64).numpy()  # (P, D)
    i = np.arange(d_model // 2)
    omega = base ** (-2 * i / d_model)
    plt = _pyplot()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5), gridspec_kw={"width_ratios": [1.6, 1]})
    im = ax1.imshow(table, aspect="auto", cmap="RdBu", vmin=-1, vmax=1, interpolation="nearest")
    ax1.set(xlabel="dimension (sin at 2i, cos at 2i+1)", ylabel="position", title="sinusoidal PE (note 000 §3.1)")
    fig.colorbar(im, ax=ax1)
    ax2.semilogy(i, omega, label="frequency w_i = 10000^(-2i/d)")
    ax2.semilogy(i, 2 * math.pi / omega, label="wavelength 2 pi / w_i (positions)")
    ax2.set(xlabel="pair index i", title="frequencies (note 000 §11.2)")
    ax2.legend(fontsize=8)
    return _save(fig, out)


def rope_rotation(out: Path, *, head_dim: int = 16, positions: int = 32, theta: float = 10000.0) -> Path:
    """Left: one (q_i, q_{i+Dh/2}) pair of a fixed vector rotated by m w_i for m = 0..positions-1, for
    several frequencies. Right: the score q~_m . k~_n over (m, n) is constant along diagonals: it depends
    on n - m only (note 003, R_m^T R_n = R_{n-m})."""
    import torch


    if head_dim < 2 or head_dim % 2 or positions < 2:
        raise QkvError(f"--head-dim={head_dim} must be even and --positions={positions} at least 2")
    rotary = Rotary(head_dim=head_dim, rope_theta=theta)
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, 1, 1, head_dim, generator=gen, dtype=torch.float64).expand(1, 1, positions, head_dim)
    k = torch.randn(1, 1, 1, head_dim, generator=gen, dtype=torch.float64).expand(1, 1, positions, head_dim)
    pos = torch.arange(positions)[None]
    q_rot, k_rot = rotary.rotate(q, k, pos)
    scores = (q_rot[0, 0] @ k_rot[0, 0].T).numpy()  # (m, n)
    plt = _pyplot()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.8))
    half = head_dim // 2
    for i in sorted({0, 1, half // 2, half - 1}):
        pair = q_rot[0, 0, :, [i, i + half]].numpy()
        ax1.plot(pair[:, 0], pair[:, 1], "o-", ms=3, lw=0.8, label=f"pair {i}: w = {theta ** (-2 * i / head_dim):.2g}")
    ax1.set(aspect="equal", title="RoPE: pair rotated by m w_i, m = 0..%d" % (positions - 1))
    ax1.legend(fontsize=7)
    im = ax2.imshow(scores, cmap="RdBu", interpolation="nearest")
    ax2.set(xlabel="key position n", ylabel="query position m", title="q~_m . k~_n depends on n - m only")
    fig.colorbar(im, ax=ax2)
    return _save(fig, out)


# ---- training curves ---------------------------------------------------------------------------

def read_metrics(run: Path) -> dict[str, np.ndarray]:
    """metrics.csv as columns of floats (NaN where a row has no value)."""
    path = Path(run) / "metrics.csv" if Path(run).is_dir() else Path(run)
    if not path.is_file():
        raise QkvError(f"{run}: no metrics.csv")
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    if not rows:
        raise QkvError(f"{path}: has no rows yet")
    def number(row: int, key: str, text) -> float:
        try:
            return float(text) if text not in (None, "") else np.nan
        except (TypeError, ValueError):
            raise QkvError(f"{path}: row {row + 1}: {key}={text!r} is not a number") from None

    return {key: np.array([number(i, key, r.get(key)) for i, r in enumerate(rows)]) for key in rows[0]}


def loss_curves(runs: list[Path], out: Path) -> Path:
    """Training loss (line) and validation loss (markers) against steps, one colour per run."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.8))
    for n, run in enumerate(runs):
        m = read_metrics(run)
        color = f"C{n}"
        train = ~np.isnan(m["loss"])
        ax.plot(m["step"][train], m["loss"][train], color=color, lw=1.2, label=f"{Path(run).name} train")
        val = ~np.isnan(m["val_loss"])
        if val.any():
            ax.plot(m["step"][val], m["val_loss"][val], "o--", color=color, ms=4, label=f"{Path(run).name} validation")
    ax.set(xlabel="step", ylabel="cross-entropy (nats/token)", title="loss")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, out)


def lr_schedules(train_cfg, d_model: int, out: Path, names: list[str] | None = None) -> Path:
    """Every schedule of qkv.schedules (or `names`) over train_cfg.max_steps updates."""
    names = names or SCHEDULES.names()
    steps = np.arange(train_cfg.max_steps)
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(names), figsize=(3.6 * len(names), 3.4), squeeze=False)
    for ax, name in zip(axes[0], names):
        schedule = SCHEDULES.get(name)
        lrs = [schedule(int(s), lr=train_cfg.lr, min_lr=train_cfg.min_lr, warmup=train_cfg.warmup_steps,
                        total=train_cfg.max_steps, d_model=d_model) for s in steps]
        ax.plot(steps, lrs)
        ax.axvline(train_cfg.warmup_steps - 1, color="gray", lw=0.6, ls=":")
        ax.set(title=name, xlabel="step")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("learning rate")
    return _save(fig, out)


def grad_norms(norms: dict[str, list[float]], out: Path) -> Path:
    """Per-layer gradient norms at initialisation, one line per placement (Pre-LN vs Post-LN)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for name, values in norms.items():
        ax.plot(range(len(values)), values, "o-", label=name)
    ax.set(xlabel="layer", ylabel="||dL/dtheta_layer||_2", title="gradient norm per layer at initialisation")
    ax.grid(alpha=0.3)
    ax.legend()
    return _save(fig, out)


def scaling_fit(x: np.ndarray, y: np.ndarray, law, out: Path, *, xlabel: str) -> Path:
    """Measured losses and the fitted L(x) = a / x^b + c on log-log axes (note 000 LLM §8.2)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.loglog(x, y, "o", label="runs")
    grid = np.geomspace(x.min() / 2, x.max() * 4, 200)
    ax.loglog(grid, law(grid), "-", label=f"L = {law.a:.3g} / x^{law.b:.3f} + {law.c:.3f}")
    ax.axhline(law.c, color="gray", ls=":", lw=0.8, label="irreducible c")
    ax.set(xlabel=xlabel, ylabel="loss", title="power-law fit")
    ax.legend(fontsize=8)
    return _save(fig, out)
