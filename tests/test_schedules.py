"""Learning-rate schedules against their closed forms (SPEC claim 26) and torch's OneCycleLR; the batch-size
ramp and the LR scaling rules (SPEC B3, B9)."""
import dataclasses
import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from qkv.config import TrainConfig
from qkv.presets import get as get_preset
from qkv.train.checks import check_run
from qkv.errors import QkvError
from qkv import schedules
from qkv.schedules import LR_SCALING, SCHEDULES, batch_rows

LR, MIN_LR, D_MODEL = 3e-3, 3e-4, 512


def lr_at(name: str, step: int, *, warmup: int, total: int, lr: float = LR, min_lr: float = MIN_LR) -> float:
    return SCHEDULES.get(name)(step, lr=lr, min_lr=min_lr, warmup=warmup, total=total, d_model=D_MODEL)


def test_registry_names():
    assert {"constant", "cosine", "linear", "noam", "onecycle"} <= set(SCHEDULES.names())


@pytest.mark.parametrize("name", ["constant", "cosine", "linear", "wsd"])
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
    for name in ("cosine", "linear", "onecycle", "wsd"):
        values = [lr_at(name, s, warmup=warmup, total=total) for s in range(warmup, total)]
        assert values[0] == pytest.approx(LR, rel=1e-12)
        assert values[-1] == pytest.approx(MIN_LR, rel=1e-12)
        assert all(b <= a + 1e-15 for a, b in zip(values, values[1:]))
        assert min(values) >= MIN_LR - 1e-15


def test_onecycle_equals_torch_onecyclelr_phase_by_phase():
    """Linear from lr/25 up to lr over `warmup`, then cosine to min_lr at the last step (note 000 LLM §10.1),
    against torch's OneCycleLR: its linear strategy for the rise, its cosine strategy for the fall."""
    warmup, total = 12, 60
    ours = [lr_at("onecycle", s, warmup=warmup, total=total) for s in range(total)]

    def torch_curve(strategy: str) -> list[float]:
        opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=LR)
        sched = torch.optim.lr_scheduler.OneCycleLR(
            opt, max_lr=LR, total_steps=total, pct_start=(warmup + 1) / total, anneal_strategy=strategy,
            div_factor=25.0, final_div_factor=LR / 25.0 / MIN_LR, cycle_momentum=False)
        values = []
        for _ in range(total):
            values.append(opt.param_groups[0]["lr"])
            opt.step()
            sched.step()
        return values

    assert ours[: warmup + 1] == pytest.approx(torch_curve("linear")[: warmup + 1], rel=1e-9)
    assert ours[warmup:] == pytest.approx(torch_curve("cos")[warmup:], rel=1e-9)
    assert ours[0] == pytest.approx(LR / 25, rel=1e-12) and ours[warmup] == pytest.approx(LR, rel=1e-12)
    assert ours[-1] == pytest.approx(MIN_LR, rel=1e-12) and max(ours) == ours[warmup]


def test_batch_rows_ramp_linearly_from_start_to_batch_size():
    rows = [batch_rows(s, batch_size=32, start=4, warmup_steps=8) for s in range(12)]
    assert rows == [4 + 28 * s // 8 for s in range(8)] + [32] * 4
    assert rows[:3] == [4, 7, 11] and rows[7] == 28
    assert all(batch_rows(s, batch_size=32, start=4, warmup_steps=0) == 32 for s in range(5))


def test_seq_cols_climb_in_equal_stages_of_the_start():
    """cols(s) = L0 (1 + floor((L / L0 - 1) s / W)) for s < W, then L (Li et al. 2022)."""
    cols = [schedules.seq_cols(s, seq_len=256, start=64, warmup_steps=300) for s in range(0, 400, 50)]
    assert cols == [64, 64, 128, 128, 192, 192, 256, 256]
    assert schedules.seq_cols(99, seq_len=256, start=64, warmup_steps=300) == 64
    assert schedules.seq_cols(100, seq_len=256, start=64, warmup_steps=300) == 128
    assert schedules.seq_cols(299, seq_len=256, start=64, warmup_steps=300) == 192
    assert all(schedules.seq_cols(s, seq_len=32, start=8, warmup_steps=0) == 32 for s in range(3))
    tc = TrainConfig(seq_len=32, seq_warmup_steps=4, seq_warmup_start=8)
    assert [schedules.step_cols(tc, s) for s in range(6)] == [8, 8, 16, 24, 32, 32]


def test_lr_scaling_rules():
    assert LR_SCALING.get("none")(4.0) == 1.0
    assert LR_SCALING.get("linear")(4.0) == 4.0  # batch x k -> lr x k (note 000 LLM §10.2)
    assert LR_SCALING.get("sqrt")(4.0) == 2.0


# ------------------------------------------------------------------------------------------ time budget horizon


def test_progress_bar_length_is_unknown_until_a_time_budget_is_fitted():
    timed = TrainConfig(max_time=60.0, max_steps=100_000)
    assert schedules.known_horizon(timed, timed.max_steps) is None  # not the 100,000-step cap's hours-long ETA
    clock = schedules.Clock(0.0)
    horizon = schedules.fit_horizon(timed, 50, 10.0, timed.max_steps, clock)  # 0.2 s a step, past 5% of 60 s
    assert horizon == 50 + int(50 / 0.2) and schedules.known_horizon(timed, horizon) == horizon
    assert schedules.known_horizon(TrainConfig(max_steps=7), 7) == 7


def test_time_horizon_follows_the_speed_since_the_last_fit():
    """A slow start (a busy machine) is forgotten at the next check: the horizon uses the recent speed."""
    timed = TrainConfig(max_time=100.0, max_steps=100_000)
    clock = schedules.Clock(0.0)
    horizon = schedules.fit_horizon(timed, 10, 10.0, timed.max_steps, clock)  # 1 s a step at first
    assert horizon == 10 + 90 and clock.checks == [0.2, 0.5]
    horizon = schedules.fit_horizon(timed, 110, 20.0, horizon, clock)  # then 0.1 s a step
    assert horizon == 110 + int(80 / 0.1)  # the whole-run average (0.18 s) would give 554
    assert clock.checks == [0.5] and clock.fitted == (20.0, 110)
    assert schedules.fit_horizon(timed, 120, 21.0, horizon, clock) == horizon  # no check due: unchanged
    assert schedules.fit_horizon(TrainConfig(max_steps=9), 5, 1e9, 9, schedules.Clock(0.0)) == 9  # no budget


def test_a_horizon_reached_early_is_fitted_again_and_one_reached_late_is_not():
    """A slow start fits a short horizon; if the steps then speed up, the run reaches it long before the next
    check: it is re-estimated there from the recent speed, not ended with most of the budget unspent."""
    timed = TrainConfig(max_time=100.0, max_steps=100_000)
    clock = schedules.Clock(0.0)
    horizon = schedules.fit_horizon(timed, 10, 10.0, timed.max_steps, clock)  # 1 s a step at first
    assert horizon == 100 and clock.checks == [0.2, 0.5]
    assert schedules.fit_horizon(timed, 99, 18.9, horizon, clock) == 100  # not reached yet: no fit
    horizon = schedules.fit_horizon(timed, 100, 19.0, horizon, clock)  # reached at 19 s: 0.1 s a step since
    assert horizon == 100 + int(81 / 0.1) and clock.fitted == (19.0, 100)
    late = schedules.Clock(0.0)
    late.checks, late.fitted = [], (50.0, 500)
    assert schedules.fit_horizon(timed, 950, 95.0, 950, late) == 950  # reached with 5% left: the run ends
    assert late.fitted == (50.0, 500)


def test_step_rows_ramp_and_split_evenly_over_the_data_parallel_ranks():
    tc = TrainConfig(batch_size=16, batch_warmup_steps=4, batch_warmup_start=3)
    assert [schedules.step_rows(tc, s) for s in range(6)] == [3, 6, 9, 12, 16, 16]
    assert [schedules.step_rows(tc, s, dp=4) for s in range(6)] == [4, 4, 8, 12, 16, 16]


def test_learning_rate_scales_with_the_rows():
    tc = TrainConfig(schedule="constant", lr=1e-3, warmup_steps=0, lr_scaling="sqrt", batch_size=8, base_batch=2)
    assert schedules.learning_rate(tc, 5, horizon=10, d_model=64) == pytest.approx(2e-3, rel=1e-12)
    assert schedules.learning_rate(tc, 5, horizon=10, d_model=64, rows=2) == pytest.approx(1e-3, rel=1e-12)


@given(warmup=st.integers(0, 40), extra=st.integers(2, 300), fraction=st.floats(0.05, 1.0))
def test_wsd_is_flat_then_a_straight_line_over_the_last_fraction(warmup, extra, fraction):
    """The closed form: lr on [warmup, D], then lr + (min_lr - lr) (s - D) / (total - 1 - D), with
    D = total - 1 - round(fraction (total - warmup)) (never before the warmup's end)."""
    total = warmup + extra
    decay_start = max(warmup, total - 1 - round(fraction * (total - warmup)))
    for step in range(warmup, total):
        value = SCHEDULES.get("wsd")(step, lr=LR, min_lr=MIN_LR, warmup=warmup, total=total, d_model=D_MODEL,
                                     decay_fraction=fraction)
        expected = LR if step <= decay_start else LR + (MIN_LR - LR) * (step - decay_start) / (total - 1 - decay_start)
        assert value == pytest.approx(expected, rel=1e-12)
    decaying = sum(1 for s in range(warmup, total) if s > decay_start)
    assert abs(decaying - fraction * (total - warmup)) <= 1.0  # the last `fraction` of the steps after warmup


def test_train_decay_fraction_reaches_the_schedule():
    tc = TrainConfig(schedule="wsd", lr=1.0, min_lr=0.0, warmup_steps=0, decay_fraction=0.5)
    values = [schedules.learning_rate(tc, s, horizon=101, d_model=8) for s in range(101)]
    assert values[:51] == [1.0] * 51 and values[75] == pytest.approx(0.5) and values[-1] == 0.0


@given(warmup=st.integers(0, 40), extra=st.integers(2, 300), fraction=st.floats(0.05, 1.0))
def test_wsd_sqrt_cooldown_is_lr_minus_the_square_root_of_its_progress(warmup, extra, fraction):
    """decay_shape "sqrt": the same flat part, then lr + (min_lr - lr) sqrt((s - D) / (total - 1 - D)) (Hägele et
    al. 2024's 1 - sqrt cooldown): min_lr at the last step, never rising, never above the straight line's value
    below it, and never below min_lr."""
    total = warmup + extra
    decay_start = max(warmup, total - 1 - round(fraction * (total - warmup)))
    wsd = SCHEDULES.get("wsd")
    values = []
    for step in range(warmup, total):
        value = wsd(step, lr=LR, min_lr=MIN_LR, warmup=warmup, total=total, d_model=D_MODEL, decay_fraction=fraction,
                    decay_shape="sqrt")
        progress = (step - decay_start) / (total - 1 - decay_start) if step > decay_start else 0.0
        assert value == pytest.approx(LR + (MIN_LR - LR) * math.sqrt(progress), rel=1e-12)
        straight = wsd(step, lr=LR, min_lr=MIN_LR, warmup=warmup, total=total, d_model=D_MODEL,
                       decay_fraction=fraction)
        assert MIN_LR - 1e-15 <= value <= straight + 1e-15
        values.append(value)
    if decay_start < total - 1:  # (a run too short for its fraction has no cooldown step)
        assert values[-1] == pytest.approx(MIN_LR, rel=1e-12)
    assert all(b <= a + 1e-15 for a, b in zip(values, values[1:]))


def test_train_decay_shape_reaches_the_schedule_and_applies_to_wsd_only():
    tc = TrainConfig(schedule="wsd", lr=1.0, min_lr=0.0, warmup_steps=0, decay_fraction=0.5, decay_shape="sqrt")
    values = [schedules.learning_rate(tc, s, horizon=101, d_model=8) for s in range(101)]
    assert values[:51] == [1.0] * 51 and values[75] == pytest.approx(1 - math.sqrt(0.5)) and values[-1] == 0.0
    cosine = dataclasses.replace(get_preset("shakespeare"), train=TrainConfig(schedule="cosine", decay_shape="sqrt"))
    with pytest.raises(QkvError, match="train.decay_shape='sqrt' applies to train.schedule='wsd'"):
        check_run(cosine)
    bad = dataclasses.replace(get_preset("shakespeare"), train=TrainConfig(schedule="wsd", decay_shape="cosine"))
    with pytest.raises(QkvError, match="train.decay_shape='cosine' is not allowed; choose from: linear, sqrt"):
        check_run(bad)
