"""Masked-language-model batches (BERT, Devlin et al. 2019, §3.1 "Masked LM" and appendix A.1; SPEC B10).

Each row is a random window of `seq_len` tokens of the stream (the windows of `dataset.Batches`). In each
row round(mask_prob * seq_len) positions (at least one) are chosen uniformly without replacement, as BERT's
create_pretraining_data does; of those, 80% become MASK, 10% a uniformly random ordinary token and 10%
stay as they are. Targets hold the original token at the chosen positions and -100 (ignored) elsewhere.

The windows and the masks come from two PCG64 generators seeded from `seed`; `state()` is JSON, so a
resumed run draws exactly the batches it would have drawn.
"""
from __future__ import annotations

import numpy as np

from qkv.data.dataset import Batches
from qkv.errors import QkvError

MASK_SHARE, RANDOM_SHARE = 0.8, 0.1  # of the chosen positions; the remaining 0.1 keep their token
IGNORE = -100  # the target of an unchosen position (cross_entropy's ignore_index)
MASK_STREAM = 0x6D6C6D  # a second PCG64 stream for the masks ("mlm"), independent of the windows


def mask_tokens(windows: np.ndarray, rng: np.random.Generator, *, mask_prob: float, mask_id: int,
                n_regular: int) -> tuple[np.ndarray, np.ndarray]:
    """windows (B, T) -> (inputs, targets), each (B, T) int64; random ids are drawn from [0, n_regular)."""
    B, T = windows.shape
    k = max(1, round(mask_prob * T))  # predictions per row
    chosen = rng.random((B, T)).argsort(axis=1)[:, :k]  # (B, k) distinct positions per row
    action = rng.random((B, k))  # < 0.8 MASK, < 0.9 random, else keep
    random_ids = rng.integers(0, n_regular, size=(B, k))
    rows = np.arange(B)[:, None]
    originals = windows[rows, chosen]  # (B, k)
    replaced = np.where(action < MASK_SHARE, mask_id,
                        np.where(action < MASK_SHARE + RANDOM_SHARE, random_ids, originals))
    inputs = np.array(windows, dtype=np.int64)
    inputs[rows, chosen] = replaced
    targets = np.full((B, T), IGNORE, dtype=np.int64)
    targets[rows, chosen] = originals
    return inputs, targets


class MLMBatches:
    """Random windows of `seq_len` tokens, masked as above. `next()` -> (inputs, targets), (B/world, T) each.

    With world > 1 every rank draws the same global batch (windows and masks) and keeps rows rank::world.
    """

    def __init__(self, tokens: np.ndarray, seq_len: int, batch_size: int, seed: int, *, mask_id: int,
                 n_regular: int, mask_prob: float = 0.15, rank: int = 0, world: int = 1):
        if world < 1 or not 0 <= rank < world or batch_size % world:
            raise QkvError(f"batch_size={batch_size} must split evenly over world={world} (rank={rank})")
        self.windows = Batches(tokens, seq_len, batch_size, seed)  # global batches; rows are split here
        self.mask_id, self.n_regular, self.mask_prob = mask_id, n_regular, mask_prob
        self.rank, self.world = rank, world
        self._rng = np.random.Generator(np.random.PCG64([seed, MASK_STREAM]))

    def next(self) -> tuple[np.ndarray, np.ndarray]:
        windows = self.windows.next()[0]  # (B, T): the inputs of seq_len + 1 windows
        inputs, targets = mask_tokens(windows, self._rng, mask_prob=self.mask_prob, mask_id=self.mask_id,
                                      n_regular=self.n_regular)
        return inputs[self.rank :: self.world], targets[self.rank :: self.world]

    def state(self) -> dict:
        return {"windows": self.windows.state(), "masks": self._rng.bit_generator.state}

    def load_state(self, state: dict) -> None:
        if set(state) != {"windows", "masks"}:
            raise QkvError(f"data state has keys {sorted(state)}; an MLM run stores windows and masks")
        self.windows.load_state(state["windows"])
        self._rng.bit_generator.state = state["masks"]
