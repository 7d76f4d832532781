"""Stateless reference layers, each a forward/backward pair (llm.c's discipline, STYLE.md 3).

    y, cache = f_forward(x, ...)      dx = f_backward(dy, cache, grads)

One convention for every backward of the engine, llm.c's: it returns the gradient of each input it was
given (dx, or a tuple in the forward's order) and accumulates (+=) the gradients of its parameters into
`grads`, a `Grads` view of the layer's own scope, under the local names the forward read ("weight",
"bias"). A weight used twice (tied embeddings, a table shared by every layer) is simply added to twice. Formulas cite note 000, "LLM part" §3 (the backward derivations),
written "000 LLM §3.x"; see docs/derivations/ for each page. NumPy only, float64 by default.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

from qkv.registry import Registry


# ---- parameter-name plumbing: a composite layer scopes its children's names --------------------

class Grads:
    """Parameter gradients by full name, accumulated in place; each view adds under its own prefix."""

    def __init__(self, store: dict | None = None, prefix: str = ""):
        self.store: dict[str, np.ndarray] = {} if store is None else store
        self.prefix = prefix

    def scope(self, name: str) -> "Grads":
        """The view of a child layer: its "weight" is this layer's "name.weight"."""
        return Grads(self.store, f"{self.prefix}{name}.")

    def at(self, prefix: str) -> "Grads":
        """The view of an absolute scope of the same store (a stack's shared positional tables)."""
        return Grads(self.store, prefix)

    def add(self, name: str, value: np.ndarray) -> None:
        key = self.prefix + name
        self.store[key] = self.store[key] + value if key in self.store else np.array(value, copy=True)

    def local(self) -> dict[str, np.ndarray]:
        """This view's entries with the prefix stripped."""
        return {key[len(self.prefix):]: value for key, value in self.store.items() if key.startswith(self.prefix)}


def scope(params: dict, prefix: str) -> dict:
    """The entries of `params` under `prefix.`, with the prefix stripped."""
    start = prefix + "."
    return {name[len(start):]: value for name, value in params.items() if name.startswith(start)}


# ---- linear: y = x W^T + b (torch layout, W is (out, in)); 000 LLM §3.2, §3.3.2, §3.3.3 step 5 -----

def linear_forward(x: np.ndarray, weight: np.ndarray, bias: np.ndarray | None = None):
    y = x @ weight.T  # (..., out)
    if bias is not None:
        y = y + bias
    return y, (x, weight, bias is not None)


def linear_backward(dy: np.ndarray, cache, grads: Grads) -> np.ndarray:
    x, weight, has_bias = cache
    x2, dy2 = x.reshape(-1, x.shape[-1]), dy.reshape(-1, dy.shape[-1])  # (N, in), (N, out)
    grads.add("weight", dy2.T @ x2)  # 000 LLM §3.2: dW_o = (H^L)^T dL, transposed to the (out, in) layout
    if has_bias:
        grads.add("bias", dy2.sum(axis=0))  # 000 LLM §3.3.2: db = sum_t dC_t
    return dy @ weight  # 000 LLM §3.2: dH = dL W_o^T


# ---- embedding: E = onehot(X) W_E; 000 LLM §3.5 ---------------------------------------------------

def embedding_forward(ids: np.ndarray, weight: np.ndarray):
    return weight[ids], (ids, weight.shape)  # (B, T, D) == one_hot(ids) @ W_E


def embedding_backward(dy: np.ndarray, cache, grads: Grads) -> None:
    """The ids are not differentiable: nothing is returned."""
    ids, shape = cache
    dweight = np.zeros(shape, dtype=dy.dtype)
    # 000 LLM §3.5: dW_e = X_onehot^T dH^0, i.e. a scatter-add of each row of dH^0 onto its token's row
    np.add.at(dweight, ids.reshape(-1), dy.reshape(-1, shape[1]))
    grads.add("weight", dweight)


# ---- softmax and cross-entropy; 000 LLM §3.1, §6.3 (label smoothing), 000 §13.3 -------------------

def softmax(x: np.ndarray, axis: int = -1) -> np.ndarray:
    shifted = x - np.max(x, axis=axis, keepdims=True)  # max-shift: exp never overflows
    e = np.exp(shifted)
    return e / e.sum(axis=axis, keepdims=True)


def log_softmax(x: np.ndarray, axis: int = -1) -> np.ndarray:
    shifted = x - np.max(x, axis=axis, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=axis, keepdims=True))


def softmax_backward(da: np.ndarray, a: np.ndarray, axis: int = -1) -> np.ndarray:
    """dS = A * (dA - rowsum(A * dA)) (000 LLM §3.3.3 step 3): the softmax Jacobian applied row by row."""
    return a * (da - (a * da).sum(axis=axis, keepdims=True))


class CrossEntropyCache(NamedTuple):
    probs: np.ndarray  # P (N, V)
    target: np.ndarray  # y' (N, V): (1 - eps) onehot + eps / V on the counted rows
    keep: np.ndarray  # (N,) the rows not ignored
    count: int  # how many
    shape: tuple  # the logits' shape


def cross_entropy_forward(logits: np.ndarray, targets: np.ndarray, *, label_smoothing: float = 0.0,
                          ignore_index: int = -100):
    """Mean over non-ignored tokens of -sum_k y'_k log P_k, y' = (1 - eps) onehot + eps / V
    (000 LLM §2.4, §6.3; 000 §13.3). logits (..., V), targets (...) -> scalar."""
    V = logits.shape[-1]
    logp = log_softmax(logits.reshape(-1, V))  # (N, V)
    flat = targets.reshape(-1)
    keep = flat != ignore_index  # (N,)
    target = np.zeros_like(logp)
    target[np.arange(flat.size)[keep], flat[keep]] = 1.0 - label_smoothing
    target[keep] += label_smoothing / V
    count = max(int(keep.sum()), 1)
    loss = -(target * logp).sum() / count
    return loss, CrossEntropyCache(np.exp(logp), target, keep, count, logits.shape)


def cross_entropy_backward(dloss: float, cache) -> np.ndarray:
    """dL/dlogits = (P - y') / N (000 LLM §3.1: P - onehot, averaged over the N counted tokens;
    with label smoothing the one-hot becomes y', since sum_k y'_k = 1). Ignored rows get 0."""
    probs, target, keep, count, shape = cache
    dlogits = (probs - target) * keep[:, None] / count
    return (dloss * dlogits).reshape(shape)


# ---- logit soft-capping (model.logit_softcap; Gemma 2, Team et al. 2024) ---------------------------

def soft_cap_forward(z: np.ndarray, cap: float):
    """L = c tanh(Z / c): bounded in (-c, c), ~Z where |Z| << c; c = 0 leaves Z as it is."""
    if not cap:
        return z, None
    squashed = np.tanh(z / cap)
    return cap * squashed, squashed


def soft_cap_backward(dlogits: np.ndarray, squashed) -> np.ndarray:
    """dZ = dL (1 - tanh^2(Z / c)), since d/dz c tanh(z / c) = 1 - tanh^2(z / c)."""
    return dlogits if squashed is None else dlogits * (1.0 - squashed ** 2)


# ---- activations: y = act(x), dx = dy * act'(x); 000 LLM §3.3.2 (ReLU mask), note 003 -------------

_erf = np.frompyfunc(math.erf, 1, 1)


def _phi_cdf(x):  # standard normal CDF Phi(x)
    return 0.5 * (1.0 + _erf(x / math.sqrt(2.0)).astype(x.dtype))


def _sigmoid(x):
    return 0.5 * (1.0 + np.tanh(0.5 * x))  # = 1 / (1 + e^-x), without overflow for large |x|


def _gelu_tanh(x):
    """0.5 x (1 + tanh u), u = sqrt(2/pi) (x + 0.044715 x^3)."""
    return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3)))


def _gelu_tanh_grad(x):
    """0.5 (1 + tanh u) + 0.5 x (1 - tanh^2 u) u', u' = sqrt(2/pi) (1 + 3 * 0.044715 x^2)."""
    c = math.sqrt(2.0 / math.pi)
    t = np.tanh(c * (x + 0.044715 * x ** 3))
    return 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * c * (1.0 + 3 * 0.044715 * x ** 2)


# name -> (act(x), act'(x)); each derivative is written out, none is taken numerically
ACTIVATIONS: Registry[tuple] = Registry("activation")
# 000 LLM §3.3.2: dA1 = dA2 * I(A1 > 0)
ACTIVATIONS.register("relu")((lambda x: np.maximum(x, 0.0), lambda x: (x > 0).astype(x.dtype)))
# GELU(x) = x Phi(x); GELU'(x) = Phi(x) + x phi(x)
ACTIVATIONS.register("gelu")((lambda x: x * _phi_cdf(x),
                              lambda x: _phi_cdf(x) + x * np.exp(-0.5 * x * x) / math.sqrt(2 * math.pi)))
ACTIVATIONS.register("gelu_tanh")((_gelu_tanh, _gelu_tanh_grad))
# SiLU / Swish-1 (note 003): x sigma(x); derivative sigma (1 + x (1 - sigma)), since sigma' = sigma (1 - sigma)
ACTIVATIONS.register("silu")((lambda x: x * _sigmoid(x), lambda x: _sigmoid(x) * (1.0 + x * (1.0 - _sigmoid(x)))))
ACTIVATIONS.register("leaky_relu")((lambda x: np.where(x > 0, x, 0.01 * x), lambda x: np.where(x > 0, 1.0, 0.01)))
# ReLU^2 (Primer): relu(x)^2, derivative 2 relu(x)
ACTIVATIONS.register("relu2")((lambda x: np.maximum(x, 0.0) ** 2, lambda x: 2.0 * np.maximum(x, 0.0)))
ACTIVATIONS.register("relu6")((lambda x: np.clip(x, 0.0, 6.0), lambda x: ((x > 0) & (x < 6)).astype(x.dtype)))


def activation_forward(x: np.ndarray, name: str):
    return ACTIVATIONS.get(name)[0](x), (x, name)


def activation_backward(dy: np.ndarray, cache) -> np.ndarray:
    x, name = cache
    return dy * ACTIVATIONS.get(name)[1](x)
