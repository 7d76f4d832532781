"""qkv.ref.functional: linear, embedding, softmax, cross-entropy (plain and smoothed with ignored rows), the logit soft-cap and every
activation, forward and hand-written backward against torch."""
import numpy as np
import pytest

from qkv.ref import functional as fn

from tests.ref.autograd import cases, check_against_torch

CASES = cases("linear", "embedding", "softmax", "soft_cap", "cross_entropy", "activation_")


@pytest.mark.parametrize("case", CASES)
def test_backward_matches_torch_autograd(case):
    check_against_torch(case)


def test_softmax_rows_sum_to_one_and_ignore_a_shift():
    x = np.random.default_rng(0).normal(scale=30.0, size=(5, 7))  # large logits: the max is subtracted
    p = fn.softmax(x)
    np.testing.assert_allclose(p.sum(-1), 1.0, rtol=1e-14)
    np.testing.assert_allclose(fn.softmax(x + 1000.0), p, rtol=1e-12)
    np.testing.assert_allclose(fn.log_softmax(x), np.log(p), atol=1e-10)


def test_cross_entropy_of_uniform_logits_is_log_v_and_smoothing_is_a_mixture():
    """Uniform logits give log V whatever the targets; with smoothing eps the loss is (1 - eps) CE + eps times
    the mean over classes of -log P, and ignored rows count for nothing."""
    v, rng = 6, np.random.default_rng(1)
    loss, _ = fn.cross_entropy_forward(np.zeros((4, v)), rng.integers(0, v, 4))
    assert abs(loss - np.log(v)) < 1e-14
    logits, targets = rng.normal(size=(4, v)), np.array([0, 5, -100, 2])
    plain, _ = fn.cross_entropy_forward(logits, targets)
    smoothed, _ = fn.cross_entropy_forward(logits, targets, label_smoothing=0.2)
    uniform = -fn.log_softmax(logits)[[0, 1, 3]].mean()
    assert abs(smoothed - (0.8 * plain + 0.2 * uniform)) < 1e-13
    only_kept, _ = fn.cross_entropy_forward(logits[[0, 1, 3]], targets[[0, 1, 3]])
    assert abs(plain - only_kept) < 1e-14
