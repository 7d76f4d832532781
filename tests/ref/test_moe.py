"""qkv.ref.moe: top-k routed experts (with and without a capacity) against torch; one expert is the dense FFN."""
import numpy as np
import pytest

from qkv.ref.ffn import FFNS
from qkv.ref.moe import moe_forward

from tests.ref.autograd import cases, check_against_torch

CASES = cases("moe_")


@pytest.mark.parametrize("case", CASES)
def test_backward_matches_torch_autograd(case):
    check_against_torch(case)


def test_moe_with_one_expert_equals_the_dense_ffn():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(2, 3, 8))
    dense = {"up_proj.weight": rng.normal(size=(12, 8)), "up_proj.bias": rng.normal(size=12),
             "down_proj.weight": rng.normal(size=(8, 12)), "down_proj.bias": rng.normal(size=8)}
    moe = {"router.weight": rng.normal(size=(1, 8)), **{f"experts.0.{k}": v for k, v in dense.items()}}
    y_moe, cache = moe_forward(moe, x, ffn="mlp", activation="gelu", experts=1, top_k=1)
    y_dense, _ = FFNS.get("mlp").forward(dense, x, "gelu")
    np.testing.assert_allclose(y_moe, y_dense, atol=1e-14)
    assert cache.aux == 1.0  # E * f * P = 1 * 1 * 1: one expert is perfectly "balanced"
