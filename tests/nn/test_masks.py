import pytest
import torch

from qkv.nn.masks import attention_mask, causal_mask


@pytest.mark.parametrize("T, S", [(4, 4), (2, 5), (1, 6), (3, 3)])
def test_causal_mask_is_the_bottom_right_aligned_lower_triangle(T, S):
    mask = causal_mask(T, S)
    assert mask.dtype == torch.bool and mask.shape == (T, S)
    for t in range(T):
        query_column = S - T + t  # the queries are the last T of the S columns
        for s in range(S):
            assert bool(mask[t, s]) == (s <= query_column)


def test_square_causal_mask_equals_tril():
    assert torch.equal(causal_mask(5, 5), torch.tril(torch.ones(5, 5, dtype=torch.bool)))


def test_suffix_of_the_full_mask_is_the_cache_mask():
    """Queries T..S-1 of a full causal mask are exactly what a cache step with S keys sees."""
    assert torch.equal(causal_mask(6, 6)[-2:], causal_mask(2, 6))


def test_no_padding_means_no_mask():
    assert attention_mask(4, None, causal=True) is None
    assert attention_mask(4, None, causal=False) is None


def expected_mask(T, key_padding, causal):
    B, S = key_padding.shape
    out = torch.zeros(B, 1, T, S, dtype=torch.bool)
    for b in range(B):
        for t in range(T):
            column = S - T + t
            for s in range(S):
                visible = bool(key_padding[b, s]) and (s <= column or not causal)
                out[b, 0, t, s] = visible or s == column  # every query sees its own column
    return out


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("T", [5, 2])
def test_padding_mask_hides_pad_keys_except_a_querys_own_column(causal, T):
    key_padding = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1], [0, 1, 1, 1, 0]])  # 1 = real token
    mask = attention_mask(T, key_padding, causal=causal)
    assert mask.shape == (3, 1, T, 5) and mask.dtype == torch.bool
    assert torch.equal(mask, expected_mask(T, key_padding, causal))


def test_left_pad_query_sees_only_itself_and_every_row_has_a_visible_key():
    key_padding = torch.tensor([[0, 0, 0, 1]])
    mask = attention_mask(4, key_padding, causal=True)[0, 0]
    assert torch.equal(mask[:3], torch.eye(4, dtype=torch.bool)[:3])  # pads: own column only, no NaN row
    assert torch.equal(mask[3], torch.tensor([False, False, False, True]))  # the real token ignores the pads
    assert mask.any(-1).all()


def test_real_tokens_of_a_padded_row_see_exactly_the_real_causal_prefix():
    key_padding = torch.tensor([[0, 0, 1, 1, 1, 1]])
    mask = attention_mask(6, key_padding, causal=True)[0, 0]
    assert torch.equal(mask[2:, 2:], torch.tril(torch.ones(4, 4, dtype=torch.bool)))
    assert not mask[2:, :2].any()
