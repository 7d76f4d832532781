"""Linear attention (note 000 §15.2; Katharopoulos et al. 2020) with its own backward.

    O_i = phi(q_i)^T sum_j phi(k_j) v_j^T / (phi(q_i)^T sum_j phi(k_j)),   phi(x) = elu(x) + 1 > 0

computed in O(n d^2) through the sums KV = Kf^T V (Dh, Dh) and z = Kf^T 1 (Dh,), or their prefix sums
when causal. Derivation (docs/derivations/linear_attention.md): with N_i = Qf_i KV_i, den_i = Qf_i . z_i,
O = N / den,
    dN = dO / den;   dden_i = -(dO_i . O_i) / den_i
    dQf_i = dN_i KV_i^T + dden_i z_i
    G_j = sum_{i sees j} Qf_i^T dN_i (Dh, Dh);   g_j = sum_{i sees j} dden_i Qf_i
    dKf_j = G_j v_j + g_j;   dV_j = G_j^T Kf_j
    dq = dQf * phi'(q), phi'(x) = 1 (x > 0), e^x (x <= 0).
The feature map replaces exp(q.k / sqrt(d_k)), so `scale` does not apply. A padding mask, a score bias
or a value term has no O(n) form: then `explicit_forward` computes the O(n^2) form, as the torch kernel.
"""
from __future__ import annotations

import numpy as np

from qkv.errors import QkvError
from qkv.ref.kernels import KERNELS, Kernel, KernelGrads, allowed_mask


def elu_plus_one(x):
    return np.where(x > 0, x + 1.0, np.exp(np.minimum(x, 0.0)))


def elu_plus_one_grad(x):
    return np.where(x > 0, 1.0, np.exp(np.minimum(x, 0.0)))


def _prefix(x: np.ndarray, causal: bool, axis: int = 2) -> np.ndarray:
    """sum over j <= i along the key axis when causal, else the full sum broadcast to every i."""
    return np.cumsum(x, axis=axis) if causal else x.sum(axis=axis, keepdims=True)


def _suffix(x: np.ndarray, causal: bool, axis: int = 2) -> np.ndarray:
    """sum over i >= j (the queries that see key j): the adjoint of _prefix."""
    return np.flip(np.cumsum(np.flip(x, axis), axis), axis) if causal else x.sum(axis=axis, keepdims=True)


def linear_forward(q, k, v, *, mask, causal, bias, scale, value_bias=None):
    if mask is not None or bias is not None or value_bias is not None:  # no O(n) form: the explicit one
        return explicit_forward(q, k, v, mask=mask, causal=causal, bias=bias, value_bias=value_bias)
    if causal and q.shape[-2] != k.shape[-2]:
        raise QkvError("attention='linear' with causal masking needs as many queries as keys (no KV cache)")
    qf, kf = elu_plus_one(q), elu_plus_one(k)  # (B, H, T, Dh), (B, H, S, Dh)
    kv = _prefix(kf[..., :, None] * v[..., None, :], causal)  # KV_i (B, H, T or 1, Dh, Dv)
    z = _prefix(kf, causal)  # z_i (B, H, T or 1, Dh)
    numer = np.einsum("bhtd,bhtde->bhte", qf, np.broadcast_to(kv, qf.shape + v.shape[-1:]))
    den = (qf * z).sum(axis=-1, keepdims=True)  # (B, H, T, 1)
    out = numer / den
    return out, (q, k, v, qf, kf, kv, z, den, out, causal)


def linear_backward(dout, cache):
    if isinstance(cache[0], str):  # ("explicit", ...)
        return explicit_backward(dout, cache[1:])
    q, k, v, qf, kf, kv, z, den, out, causal = cache
    dnumer = dout / den  # (B, H, T, Dv)
    dden = -(dout * out).sum(axis=-1, keepdims=True) / den  # (B, H, T, 1)
    kv_full = np.broadcast_to(kv, qf.shape + v.shape[-1:])
    dqf = np.einsum("bhte,bhtde->bhtd", dnumer, kv_full) + dden * z
    big_g = _suffix(qf[..., :, None] * dnumer[..., None, :], causal)  # G_j (B, H, S or 1, Dh, Dv)
    small_g = _suffix(dden * qf, causal)  # g_j (B, H, S or 1, Dh)
    big_g = np.broadcast_to(big_g, kf.shape + v.shape[-1:])
    dkf = np.einsum("bhsde,bhse->bhsd", big_g, v) + small_g
    dv = np.einsum("bhsde,bhsd->bhse", big_g, kf)
    return KernelGrads(dqf * elu_plus_one_grad(q), dkf * elu_plus_one_grad(k), dv)


def explicit_forward(q, k, v, *, mask, causal, bias, value_bias):
    """With a padding mask, a score bias or a value term (as qkv.nn.linear_attention.linear_weights):
        sim_ij = phi(q_i).phi(k_j) exp(b_ij) [allowed_ij],  A = sim / rowsum(sim),  O = A V (+ the value term)
    the softmax identity exp(s + b) = exp(s) exp(b) with phi.phi in place of exp(s); O(n^2)."""
    qf, kf = elu_plus_one(q), elu_plus_one(k)
    product = qf @ np.swapaxes(kf, -1, -2)  # phi(q_i).phi(k_j)   (B, H, T, S)
    factor = np.ones_like(product) if bias is None else np.broadcast_to(np.exp(bias), product.shape)
    allowed = allowed_mask(q.shape[-2], k.shape[-2], mask, causal)
    if allowed is not None:
        factor = np.where(allowed, factor, 0.0)
    sim = product * factor
    den = sim.sum(axis=-1, keepdims=True)
    weights = sim / den  # A (B, H, T, S)
    out = weights @ v
    if value_bias is not None:
        out = out + value_bias.buckets(weights) @ value_bias.table
    return out, ("explicit", q, k, v, qf, kf, sim, factor, den, weights, bias is not None, value_bias)


def explicit_backward(dout, cache):
    """dA = dO V^T (+ the value term's gather); A = sim / den gives dsim = (dA - rowsum(dA * A)) / den
    (the same row rule as softmax, divided by den); dS-equivalents: d(phi.phi) = dsim * factor,
    dbias = dsim * sim (d exp(b) / db = exp(b)); dphi(Q) = d(phi.phi) phi(K), dphi(K) = d(phi.phi)^T phi(Q)."""
    q, k, v, qf, kf, sim, factor, den, weights, has_bias, value_bias = cache
    dv = np.swapaxes(weights, -1, -2) @ dout
    dweights = dout @ np.swapaxes(v, -1, -2)  # (B, H, T, S)
    dtable = None
    if value_bias is not None:
        dweights_rel, dtable = value_bias.backward(dout, weights)
        dweights = dweights + dweights_rel
    dsim = (dweights - (dweights * weights).sum(axis=-1, keepdims=True)) / den
    dproduct = dsim * factor
    dqf, dkf = dproduct @ kf, np.swapaxes(dproduct, -1, -2) @ qf
    return KernelGrads(dqf * elu_plus_one_grad(q), dkf * elu_plus_one_grad(k), dv,
                       dsim * sim if has_bias else None, dtable)


def linear_explicit(q, k, v, causal: bool):
    """The O(n^2) form of the same function: W_ij = phi(q_i) . phi(k_j), rows normalised (claim 17)."""
    weights = elu_plus_one(q) @ np.swapaxes(elu_plus_one(k), -1, -2)  # (B, H, T, S)
    if causal:
        weights = np.tril(weights)
    return (weights / weights.sum(axis=-1, keepdims=True)) @ v


KERNELS.register("linear")(lambda cfg=None: Kernel(linear_forward, linear_backward, full=False))
