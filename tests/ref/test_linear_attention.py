"""qkv.ref.linear_attention: the prefix-sum kernel against torch and against its O(n^2) explicit form (claim 17)."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from qkv.ref.linear_attention import linear_explicit, linear_forward

from tests.ref.autograd import cases, check_against_torch

CASES = cases("kernel_linear_")


@pytest.mark.parametrize("case", CASES)
def test_backward_matches_torch_autograd(case):
    check_against_torch(case)


@settings(max_examples=10, deadline=None)
@given(causal=st.booleans(), seed=st.integers(0, 2 ** 16))
def test_linear_attention_equals_its_explicit_form(causal, seed):
    """Claim 17: the O(n d^2) prefix-sum form equals the O(n^2) form with weights phi(q_i) . phi(k_j)."""
    rng = np.random.default_rng(seed)
    q, k, v = (rng.normal(size=(2, 2, 6, 3)) for _ in range(3))
    out, _ = linear_forward(q, k, v, mask=None, causal=causal, bias=None, scale=1.0)
    np.testing.assert_allclose(out, linear_explicit(q, k, v, causal), rtol=0, atol=1e-13)
