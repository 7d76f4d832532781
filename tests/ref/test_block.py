"""qkv.ref.block: Pre-LN, Post-LN, sandwich and cross-attention blocks against the torch engine's Block."""
import numpy as np
import pytest

from qkv.ref.block import RESIDUALS, Sublayer
from qkv.ref.functional import Grads
from qkv.ref.norms import NORMS

from tests.ref.autograd import cases, check_against_torch

CASES = cases("block_")


@pytest.mark.parametrize("case", CASES)
def test_backward_matches_torch_autograd(case):
    check_against_torch(case)


def _norm():
    params = {"weight": np.ones(6), "bias": np.zeros(6)}
    return Sublayer(lambda x: NORMS.get("layernorm").forward(params, x, 0.0), NORMS.get("layernorm").backward)


def _scaled(a):  # F(h) = a h: its backward is a dy
    return Sublayer(lambda h: (a * h, None), lambda dy, cache, grads: a * dy)


def test_placements_are_their_formulas():
    """Pre-LN x + F(LN(x)), Post-LN LN(x + F(x)) (000 §6.1), sandwich x + LN(F(LN(x))), with F(h) = 3h; and
    Pre-LN's residual passes dy through unchanged when F is 0 (the gradient highway)."""
    x = np.random.default_rng(0).normal(size=(2, 3, 6))
    ln = lambda z: _norm().forward(z)[0]  # noqa: E731
    pre, _ = RESIDUALS.get("pre").forward(x, _norm(), _scaled(3.0))
    post, _ = RESIDUALS.get("post").forward(x, _norm(), _scaled(3.0))
    sandwich, _ = RESIDUALS.get("sandwich").forward(x, (_norm(), _norm()), _scaled(3.0))
    np.testing.assert_allclose(pre, x + 3 * ln(x), atol=1e-13)
    np.testing.assert_allclose(post, ln(4 * x), atol=1e-13)
    np.testing.assert_allclose(sandwich, x + ln(3 * ln(x)), atol=1e-12)
    dy = np.random.default_rng(1).normal(size=x.shape)
    _, cache = RESIDUALS.get("pre").forward(x, _norm(), _scaled(0.0))
    dx = RESIDUALS.get("pre").backward(dy, cache, _norm(), _scaled(0.0), Grads(), Grads())
    np.testing.assert_allclose(dx, dy, atol=1e-15)
