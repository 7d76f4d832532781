"""qkv.ref.relative: Shaw (key and value terms), Transformer-XL and T5 score biases under naive, flash and linear
kernels against the torch engine's modules."""
import numpy as np
import pytest

from tests.ref.autograd import cases, check_against_torch

CASES = cases("relative_")


@pytest.mark.parametrize("case", CASES)
def test_backward_matches_torch_autograd(case):
    check_against_torch(case)


@pytest.mark.parametrize("bidirectional", [True, False])
@pytest.mark.parametrize("max_distance", [4, 16, 128])
def test_t5_buckets_equal_the_torch_engines(bidirectional, max_distance):
    """Every relative position in [-300, 300], the log-spaced buckets and the clamp included."""
    import torch

    from qkv.nn.relative import t5_bucket as torch_bucket
    from qkv.ref.relative import t5_bucket

    offsets = np.arange(-300, 301)
    ours = t5_bucket(offsets, bidirectional=bidirectional, num_buckets=32, max_distance=max_distance)
    theirs = torch_bucket(torch.from_numpy(offsets), bidirectional=bidirectional, num_buckets=32,
                          max_distance=max_distance)
    np.testing.assert_array_equal(ours, theirs.numpy())
