"""qkv.claims.training (claims 21, 22, 26, 27, 30): accumulation and DDP equal to the full batch, the
schedules' peaks and endpoints, Adam's bias correction, and the IEEE formats' closed forms."""
import math

import pytest

from tests.claims import measured


def test_claims_21_22_accumulation_and_data_parallel_equal_the_full_batch(verified):
    m = measured(verified, 21)
    assert m["max|accumulated - full batch| gradient"] < 1e-12
    full, accumulated = m["loss (full, accumulated)"]
    assert abs(full - accumulated) < 1e-12
    assert measured(verified, 22)["max|DDP gradient over 2 ranks - full batch|"] < 1e-12


def test_claim_26_schedules(verified):
    m = measured(verified, 26)  # warmup 100 of 1000 steps, lr 1, min_lr 0.1, d_model 512
    assert m["noam argmax s = step + 1"] == 100
    assert m["noam peak vs d^-0.5 warmup^-0.5"][0] == pytest.approx(512 ** -0.5 * 100 ** -0.5, rel=1e-12)
    for name in ("cosine", "linear"):
        assert m[f"{name} lr at step warmup, at the last step"] == pytest.approx([1.0, 0.1], abs=1e-12)


def test_claim_27_adams_first_updates_move_each_weight_by_lr(verified):
    m, b1, b2 = measured(verified, 27), 0.9, 0.999
    assert m["mean |update| / lr, steps 1-3"] == pytest.approx([1.0] * 3, abs=1e-4)  # eps / |g| shaves a little
    # without the correction step 1 moves (1 - b1) / sqrt(1 - b2) = 3.162 lr (less where eps matters)
    assert 3.0 < m["step 1 without bias correction"] <= (1 - b1) / math.sqrt(1 - b2)


def test_claim_30_formats_and_underflow(verified):
    m = measured(verified, 30)
    closed = {"fp32": (8, 23), "fp16": (5, 10), "bf16": (8, 7)}  # exponent and mantissa bits
    for name, (e, p) in closed.items():
        bias = 2 ** (e - 1) - 1
        fmt = m["formats"][name]
        assert fmt["max"] == pytest.approx((2 - 2.0 ** -p) * 2.0 ** bias, rel=1e-12)
        assert fmt["min_normal"] == 2.0 ** (1 - bias) and fmt["eps"] == 2.0 ** -p
    flushed, scaled = m["share flushed to 0 in fp16"], m["in fp16 with loss scale 2^16"]
    assert m["nonzero fp32 gradients"] > 1000 and flushed > 0.05 and scaled < flushed / 10 and m["in bf16"] == 0.0
