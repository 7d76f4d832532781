"""Optimizers and gradient clipping in NumPy (note 000 §17.1; LLM part §4.1, §4.3, §10.3), with the
semantics of torch.optim so the two engines train identically:

    Adam   (§4.1)   g += wd * theta (coupled L2);  m = b1 m + (1 - b1) g;  v = b2 v + (1 - b2) g^2
                    theta -= lr * (m / (1 - b1^t)) / (sqrt(v) / sqrt(1 - b2^t) + eps)   (bias correction)
    AdamW  (§10.3)  theta -= lr * wd * theta first (decoupled decay), then the Adam update without L2
    SGD             g += wd * theta;  buf = momentum * buf + g (buf = g at the first step);  theta -= lr * buf
    Muon            the hidden matrices: B = mu B + G; W -= lr_m (NS5(G + mu B) sqrt(max(1, rows/cols)) + wd W);
                    AdamW for the rest (qkv.train.muon)
Weight decay applies only to parameters with >= 2 dimensions (matrices), as qkv.train.optim does.
The learning-rate schedules are qkv.schedules (plain Python, shared by both engines).
"""
from __future__ import annotations

import math
from typing import Callable

import numpy as np

from qkv.registry import Registry


def decays(value: np.ndarray) -> bool:
    """Matrices (linear and embedding weights) decay; biases and norm gains do not."""
    return value.ndim >= 2


class Adam:
    """Adam, or AdamW with `decoupled=True`. step() updates the params dict in place."""

    def __init__(self, *, betas: tuple[float, float], eps: float, weight_decay: float, decoupled: bool):
        self.beta1, self.beta2 = betas
        self.eps, self.weight_decay, self.decoupled = eps, weight_decay, decoupled
        self.t = 0
        self.m: dict[str, np.ndarray] = {}
        self.v: dict[str, np.ndarray] = {}

    def step(self, params: dict, grads: dict, lr: float) -> None:
        self.t += 1
        correction1 = 1.0 - self.beta1 ** self.t  # bias correction (LLM §4.1): E[m_t] = (1 - b1^t) E[g]
        correction2 = 1.0 - self.beta2 ** self.t
        for name, theta in params.items():
            g = grads[name]
            wd = self.weight_decay if decays(theta) else 0.0
            if self.decoupled:
                theta *= 1.0 - lr * wd  # AdamW: decay the weights, not the gradient
            elif wd:
                g = g + wd * theta  # Adam with L2: the decay term joins the gradient
            m = self.m[name] = self.beta1 * self.m.get(name, 0.0) + (1.0 - self.beta1) * g
            v = self.v[name] = self.beta2 * self.v.get(name, 0.0) + (1.0 - self.beta2) * g * g
            theta -= (lr / correction1) * m / (np.sqrt(v) / math.sqrt(correction2) + self.eps)


class SGD:
    """SGD with momentum (torch semantics: no dampening, the buffer starts at the first gradient)."""

    def __init__(self, *, momentum: float, weight_decay: float):
        self.momentum, self.weight_decay = momentum, weight_decay
        self.buf: dict[str, np.ndarray] = {}

    def step(self, params: dict, grads: dict, lr: float) -> None:
        for name, theta in params.items():
            g = grads[name] + (self.weight_decay * theta if decays(theta) else 0.0)
            buf = self.buf[name] = self.momentum * self.buf[name] + g if name in self.buf else g.copy()
            theta -= lr * buf


# Muon's Newton-Schulz iteration (train.muon_iteration): X <- a_k X + (b_k A + c_k A^2) X, A = X X^T, k = 1..5,
# from X = U / (s ||U||_F). Each entry: the five (a_k, b_k, c_k) and the safety factor s. qkv.train.muon reads
# the same table.
NS_ITERATIONS: Registry[tuple[tuple[tuple[float, float, float], ...], float]] = Registry("muon_iteration")
# Jordan et al. 2024 (Muon): one quintic, five times; it lands the singular values in about [0.7, 1.2], not at 1
NS_ITERATIONS.register("jordan")((((3.4445, -4.7750, 2.0315),) * 5, 1.0))
# Amsel et al. 2025 ("The Polar Express"): each step's quintic the minimax one for the interval the previous
# steps leave, from singular values down to about 1e-3; s = 1.02 keeps the largest inside the first interval
# (the values modded-nanogpt iterates with)
NS_ITERATIONS.register("polar_express")((((8.156554524902461, -22.48329292557795, 15.878769915207462),
                                          (4.042929935166739, -2.808917465908714, 0.5000178451051316),
                                          (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
                                          (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
                                          (2.3465413258596377, -1.7097828382687081, 0.42323551169305323)), 1.02))


def newton_schulz(u: np.ndarray, iteration: str = "jordan") -> np.ndarray:
    """The iteration's five steps on the wide orientation (NS_ITERATIONS)."""
    steps, safety = NS_ITERATIONS.get(iteration)
    tall = u.shape[0] > u.shape[1]
    x = u.T if tall else u
    x = x / (safety * np.linalg.norm(x) + 1e-7)
    for a, b, c in steps:
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if tall else x


class Muon:
    """Muon on the hidden matrices (2-D parameters inside the blocks), AdamW on the rest: qkv.train.muon.
    The Muon rate is lr * muon_lr / train.lr (the schedule scales both groups alike)."""

    def __init__(self, tc):
        self.momentum, self.scale, self.weight_decay = tc.muon_momentum, tc.muon_lr / tc.lr, tc.weight_decay
        self.iteration = tc.muon_iteration
        self.adamw = Adam(betas=(tc.beta1, tc.beta2), eps=tc.eps, weight_decay=tc.weight_decay, decoupled=True)
        self.buf: dict[str, np.ndarray] = {}

    @staticmethod
    def hidden(name: str, value: np.ndarray) -> bool:
        return value.ndim == 2 and ".blocks." in f".{name}"

    def step(self, params: dict, grads: dict, lr: float) -> None:
        rest = {name: theta for name, theta in params.items() if not self.hidden(name, theta)}
        self.adamw.step(rest, grads, lr)
        for name, theta in params.items():
            if name in rest:
                continue
            buf = self.buf[name] = self.momentum * self.buf.get(name, 0.0) + grads[name]  # B = mu B + G
            update = newton_schulz(grads[name] + self.momentum * buf, self.iteration)  # Nesterov, then NS
            rate = lr * self.scale
            theta *= 1.0 - rate * self.weight_decay
            theta -= rate * math.sqrt(max(1.0, theta.shape[0] / theta.shape[1])) * update


OPTIMIZERS: Registry[Callable[..., object]] = Registry("optimizer")
OPTIMIZERS.register("adamw")(lambda tc: Adam(betas=(tc.beta1, tc.beta2), eps=tc.eps,
                                             weight_decay=tc.weight_decay, decoupled=True))
OPTIMIZERS.register("adam")(lambda tc: Adam(betas=(tc.beta1, tc.beta2), eps=tc.eps,
                                            weight_decay=tc.weight_decay, decoupled=False))
OPTIMIZERS.register("sgd")(lambda tc: SGD(momentum=tc.beta1, weight_decay=tc.weight_decay))
OPTIMIZERS.register("muon")(Muon)


def global_norm(grads: dict) -> float:
    """||g||_2 over every parameter together (LLM §4.3)."""
    return math.sqrt(sum(float((g * g).sum()) for g in grads.values()))


def clip_grad_norm(grads: dict, max_norm: float) -> float:
    """g <- g * min(1, c / (||g||_2 + 1e-6)) in place (LLM §4.3, with torch.nn.utils.clip_grad_norm_'s
    1e-6 guard); returns the norm before clipping. max_norm <= 0 disables clipping."""
    norm = global_norm(grads)
    if max_norm > 0:
        scale = min(1.0, max_norm / (norm + 1e-6))
        for g in grads.values():
            g *= scale
    return norm
