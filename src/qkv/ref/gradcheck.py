"""Reusable proofs of the reference engine's backward passes (used by tests/ref and by `qkv verify`,
claims 9-13 and 18). NumPy only; the torch-autograd comparisons live in qkv.formats.params.

A `Case` names one layer: how to draw its inputs (tiny sizes), its forward, and its backward returning
the gradient of every differentiable input. `check_fd(name)` compares the hand-written backward with
central finite differences of L = sum(forward(x) * dy) for a random upstream gradient dy.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, NamedTuple

import numpy as np

from qkv.ref.functional import (cross_entropy_backward, cross_entropy_forward, embedding_backward,
                                embedding_forward, Grads, softmax, softmax_backward)
from qkv.registry import Registry
from qkv.ref.flash import flash_backward, flash_forward
from qkv.ref.kernels import naive_backward, naive_forward
from qkv.ref.norms import layernorm_backward, layernorm_forward


class Case(NamedTuple):
    inputs: Callable[[np.random.Generator], dict]  # every array the forward reads (float ones may be checked)
    forward: Callable[[dict], tuple]  # inputs -> (y, cache)
    backward: Callable[[np.ndarray, object], dict]  # (dy, cache) -> {input name: gradient}
    wrt: tuple[str, ...] | None = None  # inputs to check; None: every key the backward returns
    directions: int = 0  # 0: difference every element; k > 0: k random directions per input (big models)


CASES: Registry[Case] = Registry("gradient check")


def layer_grads(backward: Callable, dy: np.ndarray, cache, prefix: str = "") -> dict:
    """A backward in the engine's form (dx returned, parameter gradients accumulated) as a Case's dict:
    "x" for the input gradient (none for an embedding's ids), the parameters under `prefix` + their names."""
    grads = Grads(prefix=prefix)
    dx = backward(dy, cache, grads)
    return grads.store if dx is None else {"x": dx, **grads.store}


@dataclass
class Check:
    name: str  # "<case>: <input>"
    max_abs: float  # max |hand-written - oracle|
    max_rel: float  # max_abs / max |oracle|
    passed: bool


def numerical_grad(f: Callable[[], float], x: np.ndarray, eps: float = 1e-6) -> np.ndarray:
    """Central differences (f(x + eps e_i) - f(x - eps e_i)) / 2 eps, perturbing x in place; error O(eps^2)."""
    grad = np.zeros_like(x)
    flat, gflat = x.reshape(-1), grad.reshape(-1)
    for i in range(flat.size):
        saved = flat[i]
        flat[i] = saved + eps
        plus = f()
        flat[i] = saved - eps
        minus = f()
        flat[i] = saved
        gflat[i] = (plus - minus) / (2 * eps)
    return grad


def directional_grad(f: Callable[[], float], x: np.ndarray, units: np.ndarray, eps: float = 1e-6) -> np.ndarray:
    """(f(x + eps u) - f(x - eps u)) / 2 eps for each direction u, perturbing x in place."""
    saved = x.copy()
    slopes = []
    for u in units:
        x[...] = saved + eps * u
        plus = f()
        x[...] = saved - eps * u
        minus = f()
        slopes.append((plus - minus) / (2 * eps))
    x[...] = saved
    return np.array(slopes)


def compare(name: str, ours: np.ndarray, oracle: np.ndarray, *, rtol: float, atol: float) -> Check:
    """Pass when max |ours - oracle| <= atol + rtol * max(max |oracle|, 1): the error is measured against
    the array's scale, since finite differences carry an absolute noise of about |f| * 1e-16 / eps."""
    ours, oracle = np.asarray(ours, dtype=np.float64), np.asarray(oracle, dtype=np.float64)
    if ours.shape != oracle.shape:
        return Check(name, np.inf, np.inf, False)
    diff = float(np.abs(ours - oracle).max()) if ours.size else 0.0
    scale = max(float(np.abs(oracle).max()) if oracle.size else 0.0, 1.0)
    return Check(name, diff, diff / scale, diff <= atol + rtol * scale)


def upstream(rng: np.random.Generator, y) -> np.ndarray:
    """A random upstream gradient dy shaped like the output (a scalar output gets a random scalar)."""
    return rng.normal(size=np.shape(y))


def check_fd(case_name: str, seed: int = 0, *, eps: float = 1e-6, rtol: float = 1e-6, atol: float = 0.0) -> list[Check]:
    """Hand-written backward vs central finite differences for every differentiable input of one case."""
    case = CASES.get(case_name)
    rng = np.random.default_rng(seed)
    inputs = case.inputs(rng)
    y, cache = case.forward(inputs)
    dy = upstream(rng, y)
    grads = case.backward(dy, cache)

    def objective() -> float:
        return float((np.asarray(case.forward(inputs)[0]) * dy).sum())

    names = case.wrt or tuple(grads)
    if not case.directions:
        return [compare(f"{case_name}: {name}", grads[name], numerical_grad(objective, inputs[name], eps),
                        rtol=rtol, atol=atol) for name in names]
    checks = []
    for name in names:  # g . u against (f(x + eps u) - f(x - eps u)) / 2 eps for random unit u
        units = rng.normal(size=(case.directions,) + inputs[name].shape)
        norms = np.sqrt((units ** 2).reshape(case.directions, -1).sum(axis=1))
        units /= norms.reshape((-1,) + (1,) * inputs[name].ndim)
        ours = np.array([(grads[name] * u).sum() for u in units])
        checks.append(compare(f"{case_name}: {name}", ours, directional_grad(objective, inputs[name], units, eps),
                              rtol=rtol, atol=atol))
    return checks


def jacobian_from_backward(backward: Callable[[np.ndarray], np.ndarray], n_out: int) -> np.ndarray:
    """J[i, j] = dy_i / dx_j, row i being the backward of the unit upstream e_i (a VJP per output)."""
    return np.stack([backward(np.eye(n_out)[i]) for i in range(n_out)])


def check_all_fd(seed: int = 0) -> list[Check]:
    """Claim 12 (finite-difference half): every registered layer case."""
    return [check for name in CASES.names() for check in check_fd(name, seed)]


# ---- the SPEC claims that the reference engine measures ------------------------------------------

def layernorm_jacobian(d: int = 8, seed: int = 0, eps: float = 1e-5) -> dict:
    """Claim 9. The Jacobian of xhat = (x - mu) / sigma from the hand-written backward (one VJP per row)
    and from finite differences, against two closed forms:
        corrected:  (delta_ij - 1/d - xhat_i xhat_j / d) / sigma       (= note 000 §12.2 / LLM §3.3.1 form,
                                                                         since sum_k xhat_k = 0)
        note table: (I - 11^T / d)(I - xhat xhat^T) / sigma             (000 summary table, lacks the 1/d)
    sigma = sqrt(var + eps). Returns the max abs deviation of each from the backward's Jacobian."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=d) * 2.0 + 0.5
    params = {"weight": np.ones(d)}  # gamma = 1: the Jacobian of xhat itself
    xhat, cache = layernorm_forward(params, x, eps)
    sigma = float(np.sqrt(x.var() + eps))
    backward_jac = jacobian_from_backward(lambda dy: layernorm_backward(dy, cache, Grads()), d)
    fd_jac = np.stack([numerical_grad(lambda: float(layernorm_forward(params, x, eps)[0][i]), x) for i in range(d)])
    eye, ones = np.eye(d), np.ones((d, d))
    corrected = (eye - 1.0 / d - np.outer(xhat, xhat) / d) / sigma
    note_table = (eye - ones / d) @ (eye - np.outer(xhat, xhat)) / sigma
    return {"backward_vs_fd": float(np.abs(backward_jac - fd_jac).max()),
            "corrected_vs_backward": float(np.abs(corrected - backward_jac).max()),
            "note_table_vs_backward": float(np.abs(note_table - backward_jac).max())}


def softmax_ce_gradient(seed: int = 0, n: int = 6, v: int = 7) -> dict:
    """Claim 10: d mean CE / d logits = (P - onehot) / N, against the backward and finite differences."""
    rng = np.random.default_rng(seed)
    logits, targets = rng.normal(size=(n, v)) * 2.0, rng.integers(0, v, n)
    _, cache = cross_entropy_forward(logits, targets)
    closed = (softmax(logits) - np.eye(v)[targets]) / n
    fd = numerical_grad(lambda: float(cross_entropy_forward(logits, targets)[0]), logits)
    return {"closed_vs_backward": float(np.abs(closed - cross_entropy_backward(1.0, cache)).max()),
            "closed_vs_fd": float(np.abs(closed - fd).max())}


def softmax_row_rule(seed: int = 0, n: int = 6) -> dict:
    """Claim 11: dS = A * (dA - rowsum(A * dA)) equals the Jacobian product (diag(a) - a a^T) dA, row by row."""
    rng = np.random.default_rng(seed)
    scores, da = rng.normal(size=(n, n)), rng.normal(size=(n, n))
    a = softmax(scores)
    explicit = np.stack([(np.diag(a[i]) - np.outer(a[i], a[i])) @ da[i] for i in range(n)])
    fd = numerical_grad(lambda: float((softmax(scores) * da).sum()), scores)
    rule = softmax_backward(da, a)
    return {"rule_vs_jacobian": float(np.abs(rule - explicit).max()), "rule_vs_fd": float(np.abs(rule - fd).max())}


def embedding_scatter_add(seed: int = 0, v: int = 7, d: int = 5, n: int = 9) -> dict:
    """Claim 13: E[x] == onehot(x) W_E, and its gradient onehot^T dH == the scatter-add of dH's rows."""
    rng = np.random.default_rng(seed)
    ids, weight, dh = rng.integers(0, v, n), rng.normal(size=(v, d)), rng.normal(size=(n, d))
    onehot = np.eye(v)[ids]
    y, cache = embedding_forward(ids, weight)
    return {"lookup_vs_matmul": float(np.abs(y - onehot @ weight).max()),
            "scatter_vs_matmul": float(np.abs(layer_grads(embedding_backward, dh, cache)["weight"] - onehot.T @ dh).max())}


def attention_peak_bytes(kernel: str, n: int, d: int = 64, block: int = 64, seed: int = 0) -> int:
    """Peak bytes NumPy allocates inside one attention forward + backward (B = H = 1, causal), beyond the
    inputs: the (n, n) scores and weights for "naive", O(n) statistics plus one tile for "flash"."""
    import tracemalloc


    rng = np.random.default_rng(seed)
    q, k, v, dout = (rng.normal(size=(1, 1, n, d)) for _ in range(4))
    forward, backward = {"naive": (naive_forward, naive_backward),
                         "flash": (lambda *a, **kw: flash_forward(*a, **kw, block=block), flash_backward)}[kernel]
    tracemalloc.start()
    try:
        out, cache = forward(q, k, v, mask=None, causal=True, bias=None, scale=d ** -0.5)
        grads = backward(dout, cache)
        del out, cache, grads
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def flash_matches_naive(n: int = 33, d: int = 8, block: int = 8, seed: int = 0) -> dict:
    """Claim 18: tiled flash attention (forward and backward) equals the naive kernel."""
    rng = np.random.default_rng(seed)
    q, k, v, dout = (rng.normal(size=(2, 2, n, d)) for _ in range(4))
    kwargs = dict(mask=None, causal=True, bias=None, scale=d ** -0.5)
    out_n, cache_n = naive_forward(q, k, v, **kwargs)
    out_f, cache_f = flash_forward(q, k, v, **kwargs, block=block)
    diffs = [np.abs(a - b).max() for a, b in zip(naive_backward(dout, cache_n)[:3], flash_backward(dout, cache_f)[:3])]
    return {"forward": float(np.abs(out_n - out_f).max()), "backward": float(max(diffs))}

