import math

import pytest
import torch

from qkv.nn.kernels import KERNELS, kernel_for, naive, sdpa
from qkv.nn.masks import causal_mask

# Kernels that compute exact softmax attention, tested against the formula; the sparse and linear kernels
# (local, dilated, random, linear) compute other functions and have their own oracles. A new exact
# kernel adds its name here. Properties every kernel must keep (causality, cache) use KERNELS.names().
EXACT_KERNELS = [name for name in ("naive", "sdpa", "flash") if name in KERNELS]
WINDOW = 2  # the window of the sparse kernels (bound by kernel_for; the others ignore it)


def oracle(q, k, v, *, mask=None, causal=False, bias=None, scale=None):
    """softmax(Q K^T * scale + bias + M) V, written as loops over (b, h, t) in float64 (note 000 §2.1, §8.2)."""
    q, k, v = q.double(), k.double(), v.double()
    B, H, T, Dh = q.shape
    S = k.shape[2]
    scale = 1 / math.sqrt(Dh) if scale is None else scale
    out = torch.zeros(B, H, T, v.shape[-1], dtype=torch.float64)
    for b in range(B):
        for h in range(H):
            for t in range(T):
                scores = (k[b, h] @ q[b, h, t]) * scale  # (S,)
                if bias is not None:
                    scores = scores + bias.double().expand(B, H, T, S)[b, h, t]
                allowed = torch.ones(S, dtype=torch.bool)
                if mask is not None:
                    allowed = mask.expand(B, 1, T, S)[b, 0, t]
                elif causal:
                    allowed = torch.arange(S) <= S - T + t
                scores = torch.where(allowed, scores, torch.tensor(-math.inf, dtype=torch.float64))
                weights = torch.exp(scores - scores.max())
                out[b, h, t] = (weights / weights.sum()) @ v[b, h]
    return out


def qkv(B=2, H=3, T=5, S=5, Dh=8, dtype=torch.float32):
    return (torch.randn(B, H, T, Dh, dtype=dtype), torch.randn(B, H, S, Dh, dtype=dtype),
            torch.randn(B, H, S, Dh, dtype=dtype))


def random_mask(B, T, S):
    mask = torch.rand(B, 1, T, S) < 0.5
    mask[..., torch.arange(T), torch.arange(S - T, S)] = True  # each query sees its own column
    return mask


CASES = {
    "plain": dict(),
    "causal": dict(causal=True),
    "mask": dict(mask="random"),
    "bias": dict(bias=True),
    "bias+causal": dict(bias=True, causal=True),
    "bias+mask": dict(bias=True, mask="random"),
}


def inputs(case, T=5, S=5):
    q, k, v = qkv(T=T, S=S)
    spec = CASES[case]
    kwargs = dict(causal=spec.get("causal", False), mask=None, bias=None, scale=q.shape[-1] ** -0.5)
    if spec.get("mask"):
        kwargs["mask"] = random_mask(2, T, S)
    if spec.get("bias"):
        kwargs["bias"] = torch.randn(2, 3, T, S)
    return q, k, v, kwargs


def test_registry_has_naive_and_sdpa():
    assert {"naive", "sdpa"} <= set(KERNELS.names())
    assert KERNELS.get("naive").fn is naive and KERNELS.get("sdpa").fn is sdpa


@pytest.mark.parametrize("T, S", [(5, 5), (2, 7), (1, 6)])
@pytest.mark.parametrize("case", list(CASES))
def test_naive_matches_the_loop_oracle(case, T, S):
    q, k, v, kwargs = inputs(case, T, S)
    expected = oracle(q, k, v, **kwargs)
    torch.testing.assert_close(naive(q, k, v, **kwargs).double(), expected, rtol=1e-5, atol=1e-5)


def test_naive_is_exact_in_fp64():
    q, k, v = qkv(dtype=torch.float64)
    bias = torch.randn(2, 3, 5, 5, dtype=torch.float64)
    out = naive(q, k, v, mask=None, causal=True, bias=bias, scale=0.3)
    assert out.dtype == torch.float64
    torch.testing.assert_close(out, oracle(q, k, v, causal=True, bias=bias, scale=0.3), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("T, S", [(5, 5), (2, 7), (1, 6)])
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("kernel", [k for k in EXACT_KERNELS if k != "naive"])
def test_every_kernel_equals_naive_values_and_gradients(kernel, case, T, S):
    """Every kernel is checked against naive (DESIGN.md); T != S are cache-like suffix queries."""
    q, k, v, kwargs = inputs(case, T, S)
    for tensor in (q, k, v):
        tensor.requires_grad_(True)
    upstream = torch.randn(2, 3, T, 8)
    out_fast = kernel_for(kernel, window=WINDOW)(q, k, v, **kwargs)
    grads_fast = torch.autograd.grad(out_fast, (q, k, v), upstream)
    out_naive = naive(q, k, v, **kwargs)
    grads_naive = torch.autograd.grad(out_naive, (q, k, v), upstream)
    torch.testing.assert_close(out_fast, out_naive, rtol=1e-5, atol=1e-5)
    for fast, slow in zip(grads_fast, grads_naive):
        torch.testing.assert_close(fast, slow, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("kernel", KERNELS.names())
def test_causal_suffix_queries_equal_the_last_rows_of_the_full_computation(kernel):
    """A KV-cache step: the last T queries against all S keys == the last T rows of the full S x S pass."""
    fn = kernel_for(kernel, window=WINDOW)
    q, k, v = qkv(T=7, S=7)
    full = fn(q, k, v, mask=None, causal=True, bias=None, scale=0.35)
    for T in (1, 3):
        suffix = fn(q[:, :, -T:], k, v, mask=None, causal=True, bias=None, scale=0.35)
        torch.testing.assert_close(suffix, full[:, :, -T:], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kernel", EXACT_KERNELS)
def test_explicit_causal_mask_equals_the_causal_flag(kernel):
    fn = kernel_for(kernel, window=WINDOW)
    q, k, v = qkv(T=3, S=6)
    flagged = fn(q, k, v, mask=None, causal=True, bias=None, scale=0.5)
    explicit = fn(q, k, v, mask=causal_mask(3, 6)[None, None].expand(2, 1, 3, 6), causal=False, bias=None, scale=0.5)
    torch.testing.assert_close(flagged, explicit, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("kernel", KERNELS.names())
def test_a_query_that_sees_one_key_returns_that_value(kernel):
    q, k, v = qkv(T=4, S=4)
    out = kernel_for(kernel, window=WINDOW)(q, k, v, mask=None, causal=True, bias=None, scale=1.0)
    torch.testing.assert_close(out[:, :, 0], v[:, :, 0], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("kernel", EXACT_KERNELS)
def test_uniform_scores_average_the_values(kernel):
    """With q = 0 every score is 0 and each output is the mean of the values it sees."""
    _, k, v = qkv(T=4, S=4)
    q = torch.zeros(2, 3, 4, 8)
    out = kernel_for(kernel, window=WINDOW)(q, k, v, mask=None, causal=True, bias=None, scale=1.0)
    prefix_means = v.cumsum(2) / torch.arange(1, 5).view(1, 1, 4, 1)
    torch.testing.assert_close(out, prefix_means, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("autocasting", [False, True])
def test_sdpa_attends_bf16_in_fp32_on_the_cpu(autocasting):
    """On a CPU, bf16 q, k, v (or fp32 ones under bf16 autocast) are attended in fp32: the output and the
    gradients are the float64 formula's rounded once to bf16 (relative error <= 2^-9 each, 2^-8 allowed for
    fp32's own), where torch's bf16 kernel rounds the scores and weights too (errors up to ~1e-2 here)."""
    torch.manual_seed(0)
    q, k, v = (t.bfloat16() for t in qkv(B=2, H=2, T=64, S=64, Dh=32))
    grad = torch.randn(2, 2, 64, 32).bfloat16()
    exact = [t.double().requires_grad_() for t in (q, k, v)]
    want = sdpa(*exact, mask=None, causal=True, bias=None, scale=32 ** -0.5)
    want.backward(grad.double())
    given = [(t.float() if autocasting else t).requires_grad_() for t in (q, k, v)]
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocasting):
        out = sdpa(*given, mask=None, causal=True, bias=None, scale=32 ** -0.5)
    assert out.dtype == torch.bfloat16
    out.backward(grad.to(out.dtype))
    for got, ref in [(out, want)] + [(t.grad, e.grad) for t, e in zip(given, exact)]:
        ref = ref.detach()
        assert ((got.double() - ref).abs() <= 2 ** -8 * ref.abs() + 1e-5 * ref.abs().max()).all()
