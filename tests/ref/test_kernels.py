"""qkv.ref.kernels: naive softmax attention (causal, padded, with a bias, over cached keys) and the sparse
patterns (local, random, dilated) against torch."""
import pytest

from tests.ref.autograd import cases, check_against_torch

CASES = cases("kernel_naive_", "kernel_local", "kernel_random", "kernel_dilated")


@pytest.mark.parametrize("case", CASES)
def test_backward_matches_torch_autograd(case):
    check_against_torch(case)


def test_random_kernel_offsets_are_the_torch_engines_draw():
    from qkv.nn.sparse import random_distances
    from qkv.ref.kernels import RANDOM_OFFSETS

    for window in (0, 1, 3):
        assert random_distances(window) == tuple(o + window + 1 for o in RANDOM_OFFSETS)
