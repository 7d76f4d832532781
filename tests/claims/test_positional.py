"""qkv.claims.positional (claims 3-5): sinusoidal PE's rotation property and uniqueness, RoPE's relative form,
each to float64 rounding."""
from tests.claims import measured


def test_claim_3_a_shift_is_a_rotation(verified):
    assert max(measured(verified, 3).values()) < 1e-12


def test_claim_4_positions_are_distinct_and_never_return(verified):
    m = measured(verified, 4)
    assert m["min distance between positions < 4096"] > 1.0  # no two of 4096 positions within 1 of each other
    i, j = m["closest pair"]
    assert 0 <= i < j < 4096
    assert m["nearest return: min over P in 100..49999 of ||PE(P) - PE(0)||"] > 1.0


def test_claim_5_rope_scores_depend_on_the_offset_only(verified):
    assert max(measured(verified, 5).values()) < 1e-12
