"""qkv.nn.cache: what each cache returns and keeps, against the concatenation of everything appended (the
full cache) and its last columns (the rolling one); keep_last, reorder and the position bookkeeping."""
import pytest
import torch

from qkv.nn.cache import KVCache, LayerCache, RollingLayerCache, rolling_window


def chunks(lengths, B=2, H=1, Dh=3):
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(B, H, n, Dh, generator=g), torch.randn(B, H, n, Dh, generator=g)) for n in lengths]


def test_full_cache_returns_everything_appended_and_refuses_to_overflow():
    cache = LayerCache(2, 1, 9, 3, dtype=torch.float32, device=None)
    seen_k, seen_v = [], []
    for k, v in chunks([4, 1, 3]):
        seen_k.append(k), seen_v.append(v)
        out_k, out_v = cache.append(k, v)
        assert torch.equal(out_k, torch.cat(seen_k, 2)) and torch.equal(out_v, torch.cat(seen_v, 2))
    with pytest.raises(ValueError, match="KV cache overflow: 10 > 9"):
        cache.append(*chunks([2])[0])


def test_rolling_cache_returns_the_kept_window_and_this_call_then_keeps_the_last_window():
    window = 3
    cache = RollingLayerCache(2, 1, window, 3, dtype=torch.float32, device=None)
    history = []
    for k, v in chunks([4, 1, 2, 1]):
        before = torch.cat(history, 2)[:, :, -window:] if history else k[:, :, :0]
        out_k, _ = cache.append(k, v)
        assert torch.equal(out_k, torch.cat((before, k), 2))
        history.append(k)
        assert torch.equal(cache.k, torch.cat(history, 2)[:, :, -window:]) and cache.length == min(window, sum(
            h.shape[2] for h in history))


def test_keep_last_and_reorder():
    full = LayerCache(2, 1, 8, 3, dtype=torch.float32, device=None)
    k, v = chunks([6])[0]
    full.append(k, v)
    full.keep_last(2)
    assert full.length == 2 and torch.equal(full.k[:, :, :2], k[:, :, -2:])
    full.reorder(torch.tensor([1, 1]))
    written = full.k[:, :, :full.length]  # the columns after them were never written (NaN in the tests)
    assert torch.equal(written[0], written[1]) and torch.equal(written[0, :, :2], k[1, :, -2:])


def test_kv_cache_records_positions_and_padding_only_once_padded():
    cache = KVCache(2, 2, 1, 6, 3)
    positions, padding = cache.extend(torch.tensor([[0, 1, 2], [0, 0, 1]]), torch.tensor([[1, 1, 1], [0, 1, 1]]))
    assert positions.tolist() == [[0, 1, 2], [0, 0, 1]] and padding.tolist() == [[True] * 3, [False, True, True]]
    positions, padding = cache.extend(torch.tensor([[3], [2]]), None)
    assert positions.tolist() == [[0, 1, 2, 3], [0, 0, 1, 2]] and padding[1].tolist() == [False, True, True, True]
    unpadded = KVCache(1, 1, 1, 4, 3)
    assert unpadded.extend(torch.tensor([[0, 1]]), torch.ones(1, 2))[1] is None  # no padding: no mask at all


def test_only_kernels_with_a_reach_roll():
    assert rolling_window("local", 5) == 5
    assert rolling_window("local", 0) == 0 and rolling_window("sdpa", 5) == 0 and rolling_window("random", 5) == 0
