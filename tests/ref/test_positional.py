"""qkv.ref.positional: learned absolute positions and RoPE against torch; RoPE's relative-position property
(claim 5) and its backward R_{-m}."""
from types import SimpleNamespace

import numpy as np
import pytest

from qkv.ref.positional import Rotary

from tests.ref.autograd import cases, check_against_torch

CASES = cases("learned_positions", "rope")


@pytest.mark.parametrize("case", CASES)
def test_backward_matches_torch_autograd(case):
    check_against_torch(case)


def test_rope_scores_depend_only_on_relative_position():
    """Claim 5 on the reference RoPE: q~_m . k~_n is unchanged when both positions shift together."""
    rope = Rotary(SimpleNamespace(head_dim=8, rope_theta=10000.0))
    rng = np.random.default_rng(0)
    q, k = rng.normal(size=(1, 1, 1, 8)), rng.normal(size=(1, 1, 1, 8))
    scores = []
    for shift in (0, 7, 100):
        q_rot, _, _ = rope.rotate_forward(q, q, np.array([[3 + shift]]))
        _, k_rot, _ = rope.rotate_forward(k, k, np.array([[5 + shift]]))
        scores.append(float((q_rot * k_rot).sum()))
    np.testing.assert_allclose(scores, scores[0], rtol=1e-12)


def test_rope_backward_is_rotation_by_minus_theta():
    rope = Rotary(SimpleNamespace(head_dim=4, rope_theta=10000.0))
    x = np.random.default_rng(1).normal(size=(1, 1, 3, 4))
    positions = np.array([[0, 1, 2]])
    rotated, _, cache = rope.rotate_forward(x, x, positions)
    back, _ = rope.rotate_backward(rotated, rotated, cache)
    np.testing.assert_allclose(back, x, atol=1e-15)  # R_{-m} R_m = I, and the backward is R_{-m}
