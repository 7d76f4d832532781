"""qkv.ref.ffn: the MLP and GLU feed-forwards with each activation against torch."""
import pytest

from tests.ref.autograd import cases, check_against_torch

CASES = cases("ffn_")


@pytest.mark.parametrize("case", CASES)
def test_backward_matches_torch_autograd(case):
    check_against_torch(case)
