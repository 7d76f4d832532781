"""qkv.ref.attention: multi-head self-attention (MHA, GQA with RoPE and padding, ALiBi) and cross-attention
against torch; GQA's K/V sharing."""
import numpy as np
import pytest

from qkv.ref.attention import repeat_kv

from tests.ref.autograd import cases, check_against_torch

CASES = cases("attention_", "cross_attention", "mla_")  # (mla_: multi-head latent attention, qkv.ref.mla)


@pytest.mark.parametrize("case", CASES)
def test_backward_matches_torch_autograd(case):
    check_against_torch(case)


def test_gqa_with_all_heads_is_mha():
    kv = np.random.default_rng(0).normal(size=(2, 3, 4, 5))
    assert repeat_kv(kv, 1) is kv
    grouped = repeat_kv(kv, 2)  # 3 K/V heads serving 6 query heads: head h reads kv head h // 2
    np.testing.assert_array_equal(grouped[:, 4], kv[:, 2])
