"""Supervised fine-tuning data: tokenized examples with the tokens the loss trains on, packed into rows.

An example is a sequence x_1..x_n with a mask m_t (1 where x_t is a token the model is taught to produce: an
assistant's reply, a completion). The loss is note 000 §13.1's next-token cross-entropy with the mask:

    L = - sum_t m_{t+1} log p(x_{t+1} | x_<=t) / sum_t m_{t+1}

so the target of position t is x_{t+1} where m_{t+1} = 1 and -100 (ignored) elsewhere.

Packing: examples are laid one after another into rows of seq_len tokens (an example never split between rows),
each with its document index, so that attention stays inside each example and its positions restart
(qkv.models.context); the rest of a row is padding (target -100, a document of its own). Each packed example
therefore gets exactly the per-token losses it gets alone (tests/train/test_sft.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from qkv.errors import QkvError

IGNORE = -100


@dataclass
class Examples:
    """Tokenized examples: ids[i] (n_i,) and trained[i] (n_i,) bool, the tokens the loss predicts."""

    ids: list[np.ndarray] = field(default_factory=list)
    trained: list[np.ndarray] = field(default_factory=list)
    origins: list[str] = field(default_factory=list)  # where each came from ("data.jsonl:12"), for errors

    def add(self, ids: list[int], trained: list[bool], origin: str) -> None:
        if len(ids) != len(trained):
            raise ValueError("ids and trained differ in length")
        self.ids.append(np.asarray(ids, dtype=np.int64))
        self.trained.append(np.asarray(trained, dtype=bool))
        self.origins.append(origin)

    def __len__(self) -> int:  # the number of examples
        return len(self.ids)

    @property
    def tokens(self) -> int:
        return int(sum(len(ids) for ids in self.ids))

    def targets(self, i: int) -> np.ndarray:
        """(n_i,) the target of each position: the next token where it is trained, else -100; the last: -100."""
        ids, trained = self.ids[i], self.trained[i]
        out = np.full(len(ids), IGNORE, dtype=np.int64)
        out[:-1] = np.where(trained[1:], ids[1:], IGNORE)
        return out

    def check_fits(self, seq_len: int) -> None:
        for ids, origin in zip(self.ids, self.origins):
            if len(ids) > seq_len:
                raise QkvError(f"{origin}: {len(ids)} tokens, longer than train.seq_len={seq_len}; an example is "
                               "never cut (its end would be lost): raise train.seq_len or shorten the example")


class PackedBatches:
    """Rows of packed examples, reproducible and resumable (the sampler interface of qkv.train.objectives).

    Epoch e visits the examples in the order of a permutation drawn from Generator(PCG64(seed + e)) and fills each
    row greedily in that order; a batch is the next batch_size rows. next() -> (inputs, targets, documents), each
    (batch_size, seq_len) int64. With world > 1 every rank builds the same batch (the Trainer keeps its rows)."""

    def __init__(self, examples: Examples, seq_len: int, batch_size: int, seed: int, pad_id: int):
        if len(examples) == 0:
            raise QkvError("no examples to train on")
        examples.check_fits(seq_len)
        self.examples, self.seq_len, self.batch_size = examples, seq_len, batch_size
        self.seed, self.pad_id = seed, pad_id
        self.epoch, self.cursor, self.drawn = 0, 0, 0
        self._order = self._permutation(0)

    def _permutation(self, epoch: int) -> np.ndarray:
        return np.random.Generator(np.random.PCG64(self.seed + epoch)).permutation(len(self.examples))

    def _take(self) -> int:
        """The next example's index (a new epoch after the last)."""
        if self.cursor == len(self._order):
            self.epoch, self.cursor = self.epoch + 1, 0
            self._order = self._permutation(self.epoch)
        return int(self._order[self.cursor])

    def _row(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        T = self.seq_len
        inputs, targets = np.full(T, self.pad_id, dtype=np.int64), np.full(T, IGNORE, dtype=np.int64)
        documents = np.zeros(T, dtype=np.int64)
        used, doc = 0, 0
        while True:
            i = self._take()
            n = len(self.examples.ids[i])
            if used + n > T and used > 0:
                break
            inputs[used:used + n], targets[used:used + n] = self.examples.ids[i], self.examples.targets(i)
            documents[used:used + n] = doc
            used, doc, self.cursor = used + n, doc + 1, self.cursor + 1
        documents[used:] = doc  # the padding: a document of its own, never seen by the examples
        return inputs, targets, documents

    def next(self) -> tuple[np.ndarray, ...]:
        """inputs, targets, documents (B, T) int64 and scale (B,) float32 = B / (trained tokens of the batch): the
        loss of a micro-batch of b rows is sum(losses) * scale / b, so that the step's loss and gradient are the
        mean over all the batch's trained tokens however the rows are split (accumulation, data parallel)."""
        rows = [self._row() for _ in range(self.batch_size)]
        self.drawn += 1
        inputs, targets, documents = (np.stack(parts) for parts in zip(*rows))
        scale = np.full(self.batch_size, self.batch_size / max(1, int((targets != IGNORE).sum())), dtype=np.float32)
        return inputs, targets, documents, scale

    def state(self) -> dict:
        return {"epoch": self.epoch, "cursor": self.cursor, "batches": self.drawn, "seq_len": self.seq_len,
                "batch_size": self.batch_size, "examples": len(self.examples)}

    def load_state(self, state: dict) -> None:
        mine = (self.seq_len, self.batch_size, len(self.examples))
        if (state.get("seq_len"), state.get("batch_size"), state.get("examples")) != mine:
            raise QkvError(f"data state is for seq_len={state.get('seq_len')}, batch_size={state.get('batch_size')}, "
                           f"{state.get('examples')} examples; this run has seq_len={mine[0]}, batch_size={mine[1]}, "
                           f"{mine[2]} examples")
        self.epoch, self.cursor, self.drawn = int(state["epoch"]), int(state["cursor"]), int(state["batches"])
        self._order = self._permutation(self.epoch)
