"""MLM batches (BERT §3.1, appendix A.1; SPEC B10): 15% of positions predicted, of them 80% MASK, 10% random,
10% kept; windows as dataset.Batches; JSON state for resume; ranks split one global batch."""
import json

import numpy as np
import pytest

from qkv.data.dataset import Batches
from qkv.data.mlm import IGNORE, MLMBatches, mask_tokens
from qkv.errors import QkvError

VOCAB, MASK_ID = 50, 50  # the MASK id comes after the 50 ordinary ids


def stream(n: int = 5000) -> np.ndarray:
    return (np.arange(n) * 7 % VOCAB).astype(np.uint16)


def sampler(**kw) -> MLMBatches:
    args = dict(seq_len=40, batch_size=8, seed=3, mask_id=MASK_ID, n_regular=VOCAB)
    return MLMBatches(stream(), **{**args, **kw})


def test_masking_statistics_over_many_draws():
    """Exactly round(0.15 T) positions per row (BERT's create_pretraining_data); over 400 x 8 x 40 tokens
    the shares of MASK / random / kept among them are 0.8 / 0.1 / 0.1 within 4 binomial standard errors."""
    draw, T = sampler(), 40
    chosen = mask = kept = randoms = 0
    for _ in range(400):
        inputs, targets = draw.next()
        predicted = targets != IGNORE
        assert (predicted.sum(1) == round(0.15 * T)).all()  # 6 of 40 in every row
        chosen += predicted.sum()
        mask += (inputs[predicted] == MASK_ID).sum()
        kept += (inputs[predicted] == targets[predicted]).sum()
        randoms += ((inputs[predicted] != MASK_ID) & (inputs[predicted] != targets[predicted])).sum()
    n = chosen
    for share, expected in ((mask / n, 0.8), (kept / n, 0.1 + 0.1 / VOCAB), (randoms / n, 0.1 * (1 - 1 / VOCAB))):
        assert abs(share - expected) < 4 * np.sqrt(expected * (1 - expected) / n), (share, expected)
    assert chosen == 400 * 8 * 6


def test_unchosen_positions_are_the_window_and_targets_are_the_originals():
    windows = Batches(stream(), 40, 8, 3).next()[0]  # the same windows: the first seq_len of seq_len + 1 tokens
    inputs, targets = sampler().next()
    predicted = targets != IGNORE
    assert np.array_equal(inputs[~predicted], windows[~predicted])
    assert np.array_equal(targets[predicted], windows[predicted])


def test_positions_are_uniform_and_random_ids_are_ordinary_tokens():
    rng = np.random.default_rng(0)
    windows = np.zeros((2000, 20), dtype=np.int64)
    inputs, targets = mask_tokens(windows, rng, mask_prob=0.15, mask_id=MASK_ID, n_regular=VOCAB)
    counts = (targets != IGNORE).sum(0)  # per position, expected 2000 * 3 / 20 = 300
    assert abs(counts - 300).max() < 4 * np.sqrt(300)
    replaced = inputs[(targets != IGNORE) & (inputs != MASK_ID) & (inputs != 0)]
    assert replaced.min() >= 1 and replaced.max() < VOCAB and len(np.unique(replaced)) > VOCAB // 2


def test_at_least_one_prediction_per_row():
    inputs, targets = mask_tokens(np.ones((3, 4), np.int64), np.random.default_rng(0), mask_prob=0.15,
                                  mask_id=MASK_ID, n_regular=VOCAB)
    assert ((targets != IGNORE).sum(1) == 1).all()


def test_state_is_json_and_resumes_exactly():
    a = sampler()
    a.next()
    state = json.loads(json.dumps(a.state()))
    expected = [a.next() for _ in range(3)]
    b = sampler()
    b.load_state(state)
    for want, got in zip(expected, (b.next() for _ in range(3))):
        assert all(np.array_equal(x, y) for x, y in zip(want, got))


def test_ranks_split_one_global_batch():
    whole = sampler().next()
    parts = [sampler(rank=r, world=2).next() for r in range(2)]
    for i in range(2):
        assert np.array_equal(np.concatenate([p[i] for p in parts])[np.argsort([0, 2, 4, 6, 1, 3, 5, 7])], whole[i])


def test_bad_world_is_an_error():
    with pytest.raises(QkvError, match="batch_size=8 must split evenly over world=3"):
        sampler(world=3)
