"""Learning-rate schedules against their closed forms (SPEC claim 26)."""
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from qkv.train.schedules import SCHEDULES

LR, MIN_LR, D_MODEL = 3e-3, 3e-4, 512


def lr_at(name: str, step: int, *, warmup: int, total: int, lr: float = LR, min_lr: float = MIN_LR) -> float:
    return SCHEDULES.get(name)(step, lr=lr, min_lr=min_lr, warmup=warmup, total=total, d_model=D_MODEL)


def test_registry_names():
    assert {"constant", "cosine", "linear", "noam"} <= set(SCHEDULES.names())


@pytest.mark.parametrize("name", ["constant", "cosine", "linear"])
def test_warmup_is_linear_from_lr_over_warmup_to_lr(name):
    warmup, total = 10, 100
    for step in range(warmup):
        assert lr_at(name, step, warmup=warmup, total=total) == pytest.approx((step + 1) / warmup * LR, rel=1e-12)
    assert lr_at(name, warmup - 1, warmup=warmup, total=total) == pytest.approx(LR, rel=1e-12)  # end of warmup
    assert lr_at(name, warmup, warmup=warmup, total=total) == pytest.approx(LR, rel=1e-12)  # decay starts at lr


def test_cosine_endpoints_midpoint_and_closed_form():
    warmup, total = 10, 111  # decay over steps 10..110: the midpoint is step 60
    assert lr_at("cosine", total - 1, warmup=warmup, total=total) == pytest.approx(MIN_LR, rel=1e-12)
    assert lr_at("cosine", 60, warmup=warmup, total=total) == pytest.approx((LR + MIN_LR) / 2, rel=1e-12)
    for step in range(warmup, total):
        progress = (step - warmup) / (total - 1 - warmup)
        expected = MIN_LR + 0.5 * (LR - MIN_LR) * (1 + math.cos(math.pi * progress))
        assert lr_at("cosine", step, warmup=warmup, total=total) == pytest.approx(expected, rel=1e-12)
    assert lr_at("cosine", total + 50, warmup=warmup, total=total) == pytest.approx(MIN_LR, rel=1e-12)


def test_linear_endpoints_and_midpoint():
    warmup, total = 4, 25  # decay over steps 4..24: the midpoint is step 14
    assert lr_at("linear", warmup, warmup=warmup, total=total) == pytest.approx(LR, rel=1e-12)
    assert lr_at("linear", 14, warmup=warmup, total=total) == pytest.approx((LR + MIN_LR) / 2, rel=1e-12)
    assert lr_at("linear", total - 1, warmup=warmup, total=total) == pytest.approx(MIN_LR, rel=1e-12)
    steps = [lr_at("linear", s, warmup=warmup, total=total) for s in range(warmup, total)]
    slopes = [b - a for a, b in zip(steps, steps[1:])]
    assert all(d == pytest.approx((MIN_LR - LR) / (total - 1 - warmup), rel=1e-9) for d in slopes)


def test_no_warmup_starts_at_lr():
    for name in ("constant", "cosine", "linear"):
        assert lr_at(name, 0, warmup=0, total=50) == pytest.approx(LR, rel=1e-12)
    assert lr_at("cosine", 49, warmup=0, total=50) == pytest.approx(MIN_LR, rel=1e-12)


def test_constant_after_warmup():
    assert all(lr_at("constant", s, warmup=3, total=20) == LR for s in range(3, 40))


def test_noam_peak_at_warmup_equals_closed_form():
    warmup, scale = 400, 2.0
    values = [lr_at("noam", s, warmup=warmup, total=10_000, lr=scale) for s in range(2000)]
    peak = max(range(len(values)), key=values.__getitem__)
    assert peak + 1 == warmup  # s = step + 1 == warmup
    assert values[peak] == pytest.approx(scale * D_MODEL ** -0.5 * warmup ** -0.5, rel=1e-12)
    # "Attention Is All You Need" eq. (3) on both sides of the peak
    for step in (0, 99, 1000, 1999):
        s = step + 1
        expected = scale * D_MODEL ** -0.5 * min(s ** -0.5, s * warmup ** -1.5)
        assert values[step] == pytest.approx(expected, rel=1e-12)
    assert values[0] == pytest.approx(scale * D_MODEL ** -0.5 * warmup ** -1.5, rel=1e-12)


@given(warmup=st.integers(0, 50), extra=st.integers(2, 300))
def test_decaying_schedules_hit_min_lr_at_last_step_and_never_rise(warmup, extra):
    total = warmup + extra  # at least two decay steps
    for name in ("cosine", "linear"):
        values = [lr_at(name, s, warmup=warmup, total=total) for s in range(warmup, total)]
        assert values[0] == pytest.approx(LR, rel=1e-12)
        assert values[-1] == pytest.approx(MIN_LR, rel=1e-12)
        assert all(b <= a + 1e-15 for a, b in zip(values, values[1:]))
        assert min(values) >= MIN_LR - 1e-15
