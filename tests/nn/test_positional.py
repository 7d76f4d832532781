import math

import pytest
import torch

from qkv.errors import QkvError
from qkv.nn.positional import (ALiBi, Learned, POSITIONALS, Positional, Rotary, Sinusoidal, alibi_slopes,
                               sinusoidal_table)


def pe_closed_form(pos: int, j: int, d: int) -> float:
    """PE(pos, 2i) = sin(pos / 10000^(2i/d)), PE(pos, 2i+1) = cos(pos / 10000^(2i/d)) (note 000 §3.1)."""
    i = j // 2
    angle = pos / 10000 ** (2 * i / d)
    return math.sin(angle) if j % 2 == 0 else math.cos(angle)


def make(name: str, **overrides):
    dims = dict(d_model=16, n_heads=4, head_dim=4, max_seq_len=64, rope_theta=10000.0, max_distance=8)
    return POSITIONALS.get(name)(**{**dims, **overrides})


def test_registry_holds_the_base_encodings():
    assert {"none", "sinusoidal", "learned", "rope", "alibi"} <= set(POSITIONALS.names())


@pytest.mark.parametrize("name", POSITIONALS.names())
def test_every_encoding_builds_from_the_shared_keyword_arguments(name):
    assert isinstance(make(name), Positional)


def test_none_is_the_identity_on_every_hook_and_has_no_parameters():
    pe = make("none")
    x, q, k = torch.randn(2, 3, 16), torch.randn(2, 4, 3, 4), torch.randn(2, 4, 3, 4)
    positions = torch.arange(3).expand(2, 3)
    assert pe.embed(x, positions) is x
    assert pe.rotate(q, k, positions) == (q, k)
    assert pe.score_bias(positions, positions) is None
    assert pe.score_bias(positions, positions, q, q) is None and pe.value_bias(positions, positions) is None
    assert list(pe.parameters()) == []


# ------------------------------------------------------------------------------------------ sinusoidal


@pytest.mark.parametrize("d", [16, 7])
def test_sinusoidal_table_matches_closed_form(d):
    positions = torch.arange(0, 60)
    table = sinusoidal_table(positions, d)
    expected = torch.tensor([[pe_closed_form(p, j, d) for j in range(d)] for p in range(60)], dtype=torch.float64)
    assert table.shape == (60, d)
    # fp32 angles: |error| <= pos * 2^-24 ~ 4e-6 at pos 59
    torch.testing.assert_close(table.double(), expected, rtol=0, atol=1e-5)


def test_sinusoidal_embed_is_exact_in_fp64():
    pe = make("sinusoidal", d_model=10)
    positions = torch.tensor([[0, 1, 2], [500, 999, 1234]])
    x = torch.randn(2, 3, 10, dtype=torch.float64)
    expected = torch.tensor([[[pe_closed_form(int(p), j, 10) for j in range(10)] for p in row] for row in positions],
                            dtype=torch.float64)
    out = pe.embed(x, positions)
    assert out.dtype == torch.float64
    torch.testing.assert_close(out - x, expected, rtol=0, atol=1e-12)


@pytest.mark.parametrize("k", [1, 3, 17])
def test_sinusoidal_shift_is_a_rotation_of_each_pair(k):
    """SPEC claim 3: (PE(pos+k, 2i), PE(pos+k, 2i+1)) = R(k w_i) (PE(pos, 2i), PE(pos, 2i+1)), R built from
    k alone, the same matrix for every pos: sin(a+b) = sin a cos b + cos a sin b,
    cos(a+b) = cos a cos b - sin a sin b."""
    d = 12
    positions = torch.arange(0, 40, dtype=torch.float64)
    table = sinusoidal_table(positions, d).double().view(40, d // 2, 2)  # (pos, i, (sin, cos))
    shifted = sinusoidal_table(positions + k, d).double().view(40, d // 2, 2)
    w = torch.tensor([1 / 10000 ** (2 * i / d) for i in range(d // 2)], dtype=torch.float64)
    c, s = torch.cos(k * w), torch.sin(k * w)
    rotation = torch.stack((torch.stack((c, s), -1), torch.stack((-s, c), -1)), -2)  # (i, 2, 2)
    predicted = torch.einsum("iab,pib->pia", rotation, table)
    torch.testing.assert_close(shifted, predicted, rtol=0, atol=2e-5)
    # each block is a rotation: orthogonal with determinant 1
    torch.testing.assert_close(torch.linalg.det(rotation), torch.ones(d // 2, dtype=torch.float64))


def test_sinusoidal_positions_are_distinct():
    """SPEC claim 4: no two of the first 512 positions share an encoding."""
    table = sinusoidal_table(torch.arange(512), 32).double()
    distances = torch.cdist(table, table) + torch.eye(512, dtype=torch.float64) * 1e9
    assert distances.min() > 1e-2


def test_sinusoidal_embed_adds_the_table_at_each_rows_positions():
    pe = make("sinusoidal")
    assert isinstance(pe, Sinusoidal)
    positions = torch.tensor([[0, 1, 2, 3], [5, 6, 7, 8]])
    x = torch.randn(2, 4, 16)
    torch.testing.assert_close(pe.embed(x, positions) - x, sinusoidal_table(positions, 16), rtol=0, atol=1e-6)
    assert list(pe.parameters()) == []


# ------------------------------------------------------------------------------------------ learned


def test_learned_embed_adds_the_table_rows_at_the_positions():
    pe = make("learned", d_model=6, max_seq_len=10)
    assert isinstance(pe, Learned) and pe.weight.shape == (10, 6)
    with torch.no_grad():
        pe.weight.copy_(torch.randn(10, 6))
    positions = torch.tensor([[0, 1, 2], [7, 8, 9]])
    x = torch.randn(2, 3, 6)
    out = pe.embed(x, positions)
    for b in range(2):
        for t in range(3):
            torch.testing.assert_close(out[b, t], x[b, t] + pe.weight[positions[b, t]], rtol=0, atol=0)


def test_learned_position_beyond_the_table_is_an_error_naming_it():
    pe = make("learned", d_model=6, max_seq_len=10)
    with pytest.raises(QkvError, match="position 10 is beyond the learned table's 10 positions"):
        pe.embed(torch.zeros(1, 1, 6), torch.tensor([[10]]))


# ------------------------------------------------------------------------------------------ RoPE


def explicit_rope(x: torch.Tensor, pos: int, theta: float = 10000.0) -> torch.Tensor:
    """Rotate pair (i, i + Dh/2) of a (Dh,) vector by pos * theta^(-2i/Dh), written as 2x2 matrices."""
    dh = x.shape[-1]
    out = x.clone()
    for i in range(dh // 2):
        a = pos * theta ** (-2 * i / dh)
        r = torch.tensor([[math.cos(a), -math.sin(a)], [math.sin(a), math.cos(a)]], dtype=x.dtype)
        out[[i, i + dh // 2]] = r @ x[[i, i + dh // 2]]
    return out


def rotate_at(rope: Rotary, x: torch.Tensor, positions: list[int]) -> torch.Tensor:
    """Rotate a (1, H, T, Dh) tensor with per-token positions."""
    return rope.rotate(x, x, torch.tensor([positions]))[0]


def test_rope_matches_explicit_pair_rotations_in_fp64():
    rope = make("rope", head_dim=8, rope_theta=500.0)
    x = torch.randn(1, 2, 3, 8, dtype=torch.float64)
    positions = [0, 7, 4321]
    out = rotate_at(rope, x, positions)
    assert out.dtype == torch.float64
    for h in range(2):
        for t, pos in enumerate(positions):
            torch.testing.assert_close(out[0, h, t], explicit_rope(x[0, h, t], pos, 500.0), rtol=0, atol=1e-10)


def test_rope_rotates_q_and_k_alike_and_position_zero_is_the_identity():
    rope = make("rope", head_dim=8)
    q, k = torch.randn(2, 3, 5, 8), torch.randn(2, 3, 5, 8)
    positions = torch.tensor([[0, 1, 2, 3, 4], [9, 10, 11, 12, 13]])
    q_rot, k_rot = rope.rotate(q, k, positions)
    torch.testing.assert_close(rope.rotate(k, q, positions)[0], k_rot, rtol=0, atol=0)
    torch.testing.assert_close(q_rot[0, :, 0], q[0, :, 0], rtol=0, atol=0)
    assert (q_rot[1] - q[1]).abs().max() > 1e-2  # other positions do move


def test_rope_preserves_norms():
    rope = make("rope", head_dim=16)
    q = torch.randn(2, 4, 6, 16, dtype=torch.float64)
    positions = torch.tensor([[0, 1, 5, 50, 500, 5000], [3, 2, 1, 0, 100, 7]])
    q_rot, _ = rope.rotate(q, q, positions)
    torch.testing.assert_close(q_rot.norm(dim=-1), q.norm(dim=-1), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("offset", [1, 5, 17, 1000])
def test_rope_scores_depend_only_on_the_relative_offset(offset):
    """SPEC claim 5: q~_m . k~_n depends only on n - m. Shifting every position by `offset` keeps
    every score of a sequence; the scores also equal q^T R_{n-m} k."""
    rope = make("rope", head_dim=8)
    T = 6
    q, k = torch.randn(1, 2, T, 8), torch.randn(1, 2, T, 8)
    base = torch.arange(T)[None]
    scores_at = {}
    for shift in (0, offset):
        q_rot, k_rot = rope.rotate(q, k, base + shift)
        scores_at[shift] = q_rot @ k_rot.transpose(-2, -1)  # (1, 2, T, T)
    # fp32 angles at position ~1000 carry ~1e-4 rad of rounding: loose there, tight near 0
    tol = 1e-5 if offset < 100 else 1e-3
    torch.testing.assert_close(scores_at[offset], scores_at[0], rtol=tol, atol=tol)
    q64, k64 = q.double(), k.double()
    for m in range(T):
        for n in range(T):
            relative = q64[0, 0, m] @ explicit_rope(k64[0, 0, n], n - m)
            torch.testing.assert_close(scores_at[0][0, 0, m, n].double(), relative, rtol=1e-5, atol=1e-5)


def test_rope_scores_for_a_fixed_offset_agree_at_many_absolute_positions():
    rope = make("rope", head_dim=8)
    q, k = torch.randn(1, 1, 1, 8, dtype=torch.float64), torch.randn(1, 1, 1, 8, dtype=torch.float64)
    scores = [(rotate_at(rope, q, [m]) * rotate_at(rope, k, [m + 3])).sum() for m in (0, 2, 11, 64, 300)]
    torch.testing.assert_close(torch.stack(scores), scores[0].expand(5), rtol=1e-10, atol=1e-10)
    other = (rotate_at(rope, q, [0]) * rotate_at(rope, k, [4])).sum()
    assert abs(other - scores[0]) > 1e-3  # a different offset gives a different score


# ------------------------------------------------------------------------------------------ ALiBi


def test_alibi_slopes_for_eight_heads_are_the_papers():
    assert alibi_slopes(8).tolist() == [1 / 2, 1 / 4, 1 / 8, 1 / 16, 1 / 32, 1 / 64, 1 / 128, 1 / 256]


def test_alibi_slopes_for_a_non_power_of_two_follow_the_papers_rule():
    # Press et al.'s get_slopes(6): get_slopes_power_of_2(4) + get_slopes_power_of_2(8)[0::2][:2]
    assert alibi_slopes(6).tolist() == [2 ** -2, 2 ** -4, 2 ** -6, 2 ** -8, 2 ** -1, 2 ** -3]
    assert alibi_slopes(1).tolist() == [2 ** -8]


def test_alibi_bias_is_minus_slope_times_distance():
    pe = make("alibi", n_heads=8)
    assert isinstance(pe, ALiBi) and list(pe.parameters()) == []
    q_positions = torch.tensor([[3, 4], [0, 9]])
    k_positions = torch.tensor([[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]])
    bias = pe.score_bias(q_positions, k_positions)
    assert bias.shape == (2, 8, 2, 5)
    for b in range(2):
        for h in range(8):
            for i in range(2):
                for j in range(5):
                    expected = -(0.5 ** (h + 1)) * abs(int(q_positions[b, i]) - int(k_positions[b, j]))
                    assert bias[b, h, i, j].item() == pytest.approx(expected, abs=1e-7)
