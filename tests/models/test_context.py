"""qkv.models.context: positions count real tokens only (padding on either side moves nothing), a cache
continues them, and the masks are key padding AND the causal triangle, with each query's own column kept;
cross-attention masks source padding only."""
import torch

from qkv.models.context import cross_context, self_context, token_positions
from qkv.nn.cache import KVCache
from qkv.nn.positional import Positional


def test_positions_count_real_tokens_only():
    ids = torch.zeros(2, 5, dtype=torch.long)
    left = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    positions, counts = token_positions(ids, left, torch.tensor([0, 10]))
    assert positions.tolist() == [[0, 0, 0, 1, 2], [10, 11, 12, 13, 14]] and counts.tolist() == [3, 5]
    right = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    assert token_positions(ids, right, torch.tensor([0, 0]))[0][0, :3].tolist() == [0, 1, 2]


def test_self_context_mask_is_padding_and_causal_with_the_own_column():
    ids = torch.zeros(1, 4, dtype=torch.long)
    ctx = self_context(Positional(), ids, torch.tensor([[0, 1, 1, 1]]), None, causal=True)
    allowed = ctx.mask[0, 0].int().tolist()
    assert allowed == [[1, 0, 0, 0], [0, 1, 0, 0], [0, 1, 1, 0], [0, 1, 1, 1]]  # the pad row keeps its own column
    assert not ctx.causal  # the mask carries the triangle
    plain = self_context(Positional(), ids, None, None, causal=True)
    assert plain.mask is None and plain.causal  # no padding: the kernel applies the triangle itself


def test_a_cache_continues_positions_and_keys():
    cache = KVCache(1, 2, 1, 8, 4)
    ids = torch.zeros(2, 3, dtype=torch.long)
    first = self_context(Positional(), ids, torch.tensor([[0, 1, 1], [1, 1, 1]]), cache, causal=True)
    assert first.positions.tolist() == [[0, 0, 1], [0, 1, 2]]
    step = self_context(Positional(), ids[:, :1], None, cache, causal=True)
    assert step.positions.tolist() == [[2], [3]]  # each row's next real position
    assert step.key_positions.tolist() == [[0, 0, 1, 2], [0, 1, 2, 3]] and step.mask[0, 0, 0].tolist() == [
        False, True, True, True]  # the cached padding stays masked


def test_cross_context_masks_source_padding_only():
    ctx = cross_context(torch.tensor([[0, 1]]), torch.tensor([[1, 1, 0]]), 3)
    assert ctx.mask[0, 0].tolist() == [[True, True, False], [True, True, False]]
    assert ctx.key_positions.tolist() == [[0, 1, 2]] and cross_context(torch.tensor([[0]]), None, 3).mask is None
