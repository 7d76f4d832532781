"""qkv.ref.norms: LayerNorm and RMSNorm against torch, and the statistics each guarantees."""
import numpy as np
import pytest

from qkv.ref.norms import NORMS

from tests.ref.autograd import cases, check_against_torch

CASES = cases("norm_")


@pytest.mark.parametrize("case", CASES)
def test_backward_matches_torch_autograd(case):
    check_against_torch(case)


def test_layernorm_rows_have_zero_mean_and_unit_variance():
    """With gamma = 1 and beta = 0 each row of LN(x) has mean 0 and (biased) variance sigma^2 / (sigma^2 + eps),
    for any shift and scale of the input."""
    x = np.random.default_rng(0).normal(loc=3.0, scale=5.0, size=(4, 16))
    y, cache = NORMS.get("layernorm").forward({"weight": np.ones(16), "bias": np.zeros(16)}, x, 1e-5)
    np.testing.assert_allclose(y.mean(-1), 0.0, atol=1e-14)
    np.testing.assert_allclose(y.var(-1), (x.var(-1) / (x.var(-1) + 1e-5)), rtol=1e-12)
    shifted, _ = NORMS.get("layernorm").forward({"weight": np.ones(16), "bias": np.zeros(16)}, 7 * x - 2, 0.0)
    plain, _ = NORMS.get("layernorm").forward({"weight": np.ones(16), "bias": np.zeros(16)}, x, 0.0)
    np.testing.assert_allclose(shifted, plain, atol=1e-12)  # LN(a x + b) = LN(x) for a > 0 without eps


def test_rmsnorm_rows_have_unit_root_mean_square_and_keep_the_mean():
    """RMSNorm divides by sqrt(mean(x^2) + eps) only: unit RMS (eps = 0), no centring, so a row of equal
    values stays equal (it would be 0 under LayerNorm)."""
    rng = np.random.default_rng(1)
    x = rng.normal(loc=2.0, size=(3, 8))
    y, _ = NORMS.get("rmsnorm").forward({"weight": np.ones(8)}, x, 0.0)
    np.testing.assert_allclose(np.sqrt((y ** 2).mean(-1)), 1.0, rtol=1e-13)
    flat, _ = NORMS.get("rmsnorm").forward({"weight": np.ones(8)}, np.full((1, 8), -4.0), 0.0)
    np.testing.assert_allclose(flat, -1.0, rtol=1e-13)
