"""Linear attention (qkv.nn.linear_attention, note 000 §15.2) against its definition written as a double loop:
O_i = sum_j phi(q_i).phi(k_j) v_j / sum_j phi(q_i).phi(k_j), phi = elu + 1, over the allowed j. The O(n)
sums (non-causal), the chunked prefix sums (causal, across several chunks, T < S), and the explicit form a
mask or bias needs all agree with it, values and gradients."""
import pytest
import torch
import torch.nn.functional as F

from qkv.nn import linear_attention as la


def by_definition(q, k, v, allowed, bias=None):
    """The double loop over queries i and keys j, in float64."""
    B, H, T, _ = q.shape
    phi = lambda x: F.elu(x) + 1  # noqa: E731
    out = torch.zeros(B, H, T, v.shape[-1], dtype=torch.float64)
    for i in range(T):
        weights = (phi(q[:, :, i:i + 1]) * phi(k)).sum(-1)  # (B, H, S)
        if bias is not None:
            weights = weights * torch.exp(bias[:, :, i])
        weights = weights * allowed[i]
        out[:, :, i] = (weights[..., None] * v).sum(-2) / weights.sum(-1, keepdim=True)
    return out


def qkv_inputs(T, S, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(2, 3, n, 4, generator=g, dtype=torch.float64, requires_grad=True) for n in (T, S, S)]


@pytest.mark.parametrize("causal,T,S", [(False, 7, 7), (True, 7, 7), (True, 150, 150), (True, 70, 100)])
def test_kernel_equals_the_definition(causal, T, S):
    """150 queries cross two chunk boundaries (CHUNK = 64); T < S: the queries are the last T columns."""
    q, k, v = qkv_inputs(T, S)
    allowed = torch.ones(T, S)
    if causal:
        allowed = torch.ones(T, S).tril(S - T)
    got = la.linear(q, k, v, mask=None, causal=causal, bias=None, scale=1.0)
    want = by_definition(q, k, v, allowed)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    grads = torch.autograd.grad(got.square().sum(), (q, k, v))
    wants = torch.autograd.grad(want.square().sum(), (q, k, v))
    for g, w in zip(grads, wants):
        torch.testing.assert_close(g, w, rtol=1e-9, atol=1e-11)


def test_mask_and_bias_take_the_explicit_form():
    """sim_ij = phi(q_i).phi(k_j) exp(b_ij) over the allowed keys (the softmax identity exp(s + b) = exp(s) exp(b))."""
    q, k, v = qkv_inputs(5, 6)
    mask = torch.ones(2, 1, 5, 6, dtype=torch.bool)
    mask[1, :, :, 4:] = False  # row 1's last two keys are padding
    bias = torch.randn(2, 3, 5, 6, dtype=torch.float64)
    got = la.linear(q, k, v, mask=mask, causal=False, bias=bias, scale=1.0)
    for b in range(2):
        want = by_definition(q[b:b + 1], k[b:b + 1], v[b:b + 1], mask[b, 0].double(), bias[b:b + 1])
        torch.testing.assert_close(got[b:b + 1], want, rtol=1e-10, atol=1e-12)
    weights = la.linear_weights(q, k, mask=mask, causal=False, bias=bias)
    torch.testing.assert_close(weights.sum(-1), torch.ones(2, 3, 5, dtype=torch.float64))
    assert torch.all(weights[1, :, :, 4:] == 0)


def test_feature_map_is_positive_and_wide():
    x = torch.tensor([-10.0, -1.0, 0.0, 2.0], dtype=torch.bfloat16)
    phi = la.feature_map(x)
    assert phi.dtype == torch.float32 and torch.all(phi > 0)
    torch.testing.assert_close(phi, F.elu(x.float()) + 1)
