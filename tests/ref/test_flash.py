"""qkv.ref.flash: the tiled online-softmax kernel against torch and against naive attention (claim 18), and its
O(n) extra memory."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from qkv.ref import gradcheck
from qkv.ref.flash import flash_backward, flash_forward
from qkv.ref.kernels import naive_backward, naive_forward

from tests.ref.autograd import cases, check_against_torch

CASES = cases("kernel_flash_")


@pytest.mark.parametrize("case", CASES)
def test_backward_matches_torch_autograd(case):
    check_against_torch(case)


@settings(max_examples=15, deadline=None)
@given(t=st.integers(1, 9), s_extra=st.integers(0, 4), block=st.integers(1, 5), causal=st.booleans(),
       seed=st.integers(0, 2 ** 16))
def test_flash_equals_naive_forward_and_backward(t, s_extra, block, causal, seed):
    """Claim 18: any tile size, any T <= S (queries aligned to the last T keys), causal or not."""
    rng = np.random.default_rng(seed)
    s = t + s_extra
    q, dout = rng.normal(size=(1, 2, t, 4)), rng.normal(size=(1, 2, t, 4))
    k, v = rng.normal(size=(1, 2, s, 4)), rng.normal(size=(1, 2, s, 4))
    kw = dict(mask=None, causal=causal, bias=None, scale=0.5)
    out_n, cache_n = naive_forward(q, k, v, **kw)
    out_f, cache_f = flash_forward(q, k, v, **kw, block=block)
    np.testing.assert_allclose(out_f, out_n, rtol=0, atol=1e-13)
    for a, b in zip(flash_backward(dout, cache_f)[:3], naive_backward(dout, cache_n)[:3]):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-13)


def test_flash_claim_18_helper():
    result = gradcheck.flash_matches_naive()
    assert result["forward"] < 1e-13 and result["backward"] < 1e-13


def test_flash_extra_memory_is_linear_and_naive_quadratic():
    """Peak NumPy allocations of forward + backward: naive grows ~4x per doubling of n, flash ~2x."""
    naive = [gradcheck.attention_peak_bytes("naive", n, d=16, block=32) for n in (128, 256)]
    flash = [gradcheck.attention_peak_bytes("flash", n, d=16, block=32) for n in (128, 256)]
    assert naive[1] / naive[0] > 3.5
    assert flash[1] / flash[0] < 2.3
    assert flash[1] < naive[1] / 4
