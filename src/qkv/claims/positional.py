"""Claims about positional encodings: 3, 4, 5."""
from __future__ import annotations

import numpy as np
import torch

from qkv.claims.base import Result, claim, status
from qkv.nn.positional import Rotary, sinusoidal_table

F64 = torch.float64


def _table(positions: int, d: int) -> np.ndarray:
    return sinusoidal_table(torch.arange(positions), d, dtype=F64).numpy()  # (P, d)


def _omega(d: int) -> np.ndarray:
    return 10000.0 ** (-2 * np.arange(d // 2) / d)  # w_i (note 000 §3.1.3)


def rotation_blocks(angles: np.ndarray, sign: float = 1.0) -> np.ndarray:
    """Block-diagonal matrix of 2x2 blocks [[cos a, s sin a], [-s sin a, cos a]], one per angle."""
    d = 2 * len(angles)
    R = np.zeros((d, d))
    c, s = np.cos(angles), sign * np.sin(angles)
    R[0::2, 0::2][np.diag_indices(len(angles))] = c
    R[0::2, 1::2][np.diag_indices(len(angles))] = s
    R[1::2, 0::2][np.diag_indices(len(angles))] = -s
    R[1::2, 1::2][np.diag_indices(len(angles))] = c
    return R


@claim(3, "sinusoidal PE: PE(pos+k) = R(k) PE(pos) with 2x2 rotation blocks", "000 §3.1.4, §11.3")
def pe_shift() -> Result:
    d, P = 64, 300
    table = _table(P, d)
    measured = {}
    for k in (1, 7, 100):
        R = rotation_blocks(k * _omega(d))  # the note's [[cos kw, sin kw], [-sin kw, cos kw]] on (sin, cos) pairs
        measured[f"max|PE(pos+{k}) - R({k}) PE(pos)|"] = float(np.abs(table[k:] - table[:-k] @ R.T).max())
    return Result(status(max(measured.values()) < 1e-9), measured,
                  "qkv.nn.positional.sinusoidal_table in float64, d=64, positions 0..299; R(k) depends on k only.")


@claim(4, "PE uniqueness: distinct positions give distinct encodings; no finite period", "000 §16.3; 003 (PE)")
def pe_unique() -> Result:
    d, P = 128, 4096
    table = _table(P, d)
    gram = table @ table.T  # ||PE_i - PE_j||^2 = ||PE_i||^2 + ||PE_j||^2 - 2 PE_i . PE_j, ||PE||^2 = d/2
    dist2 = d / 2 + d / 2 - 2 * gram
    np.fill_diagonal(dist2, np.inf)
    i, j = np.unravel_index(np.argmin(dist2), dist2.shape)
    far = _table(50_000, d)
    to_zero = np.sqrt(((far[100:] - far[0]) ** 2).sum(axis=1))  # ||PE(P) - PE(0)|| for P = 100..49999
    measured = {"min distance between positions < 4096": float(np.sqrt(max(dist2.min(), 0.0))),
                "closest pair": [int(i), int(j)],
                "nearest return: min over P in 100..49999 of ||PE(P) - PE(0)||": float(to_zero.min()),
                "its P": int(to_zero.argmin() + 100)}
    ok = measured["min distance between positions < 4096"] > 0.1 and measured[
        "nearest return: min over P in 100..49999 of ||PE(P) - PE(0)||"] > 0.1
    return Result(status(ok), measured,
                  "d=128, float64. The claim holds, but not for the note's reason ('w_i is a geometric series'): "
                  "a period P would need P w_0 = P in 2 pi Z for the first pair (w_0 = 1), impossible for an "
                  "integer P != 0 because pi is irrational; the same argument gives uniqueness.")


@claim(5, "RoPE: q~_m . k~_n depends only on n - m; R_m^T R_n = R_{n-m}", "003 (RoPE)")
def rope_relative() -> Result:
    Dh, P = 16, 64
    rotary = Rotary(head_dim=Dh, rope_theta=10000.0)
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, 1, 1, Dh, generator=gen, dtype=F64).expand(1, 1, P, Dh)
    k = torch.randn(1, 1, 1, Dh, generator=gen, dtype=F64).expand(1, 1, P, Dh)
    q_rot, k_rot = rotary.rotate(q, k, torch.arange(P)[None])
    scores = (q_rot[0, 0] @ k_rot[0, 0].T).numpy()  # (m, n)
    spread = max(float(np.ptp(np.diagonal(scores, offset=delta))) for delta in range(-P + 2, P - 1))
    omega = _omega(Dh)
    # the note's R(theta) = [[cos, -sin], [sin, cos]] per pair: R_m = rotation_blocks(m w, sign=-1)
    errors = [np.abs(rotation_blocks(m * omega, -1).T @ rotation_blocks(n * omega, -1)
                     - rotation_blocks((n - m) * omega, -1)).max() for m, n in ((0, 5), (3, 17), (40, 2), (63, 63))]
    measured = {"max spread of q~_m . k~_n along each diagonal n - m": spread,
                "max|R_m^T R_n - R_(n-m)|": float(max(errors))}
    return Result(status(spread < 1e-10 and max(errors) < 1e-12), measured,
                  "qkv's Rotary module (float64, Dh=16, positions 0..63; it pairs (i, i + Dh/2), a fixed "
                  "permutation of the note's (2i, 2i+1) that leaves every dot product unchanged) and the note's "
                  "block matrices.")
