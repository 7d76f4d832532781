"""The genre-classification set (docs/tasks.md "Genre classification"): passages of the bundled plays labelled
comedy / history / tragedy by their work, split by whole works.

- Genre: the First Folio's own division (1623) into "Comedies", "Histories" and "Tragedies" (its catalogue).
  Troilus and Cressida is missing from the catalogue but printed between the histories and the tragedies under
  the head "The Tragedie of Troylus and Cressida": tragedy. Cymbeline closes the Tragedies. Pericles is not in
  the Folio, so it has no label and is left out, with the five poems (Sonnets, A Lover's Complaint, The
  Passionate Pilgrim, The Phoenix and the Turtle, The Rape of Lucrece).
- Text: the modern-spelling edition only (the Folio twin of a held-out play would leak it), from its first
  act heading on: the title and the list of persons (which name the genre: "THE TRAGEDY OF ...") are cut.
- Split: within each genre, works ordered by sha256 of their id; the first TEST_PER_GENRE are test, the next
  VAL_PER_GENRE validation, the rest train. Deterministic, stratified, no work on two sides.
- Passages: windows of T tokens inside one work (never across two). Training draws windows at uniform
  random offsets; evaluation uses every non-overlapping window of each held-out work, in order.
"""
from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass

import numpy as np

from qkv.data.corpus import Document, bundled_documents
from qkv.errors import QkvError

LABELS = ("comedy", "history", "tragedy")
COMEDIES = ("tempest", "two_gentlemen_of_verona", "merry_wives_of_windsor", "measure_for_measure",
            "comedy_of_errors", "much_ado_about_nothing", "loves_labours_lost", "midsummer_nights_dream",
            "merchant_of_venice", "as_you_like_it", "taming_of_the_shrew", "alls_well_that_ends_well",
            "twelfth_night", "winters_tale")
HISTORIES = ("john", "richard_ii", "henry_iv_part_1", "henry_iv_part_2", "henry_v", "henry_vi_part_1",
             "henry_vi_part_2", "henry_vi_part_3", "richard_iii", "henry_viii")
TRAGEDIES = ("troilus_and_cressida", "coriolanus", "tragedy_of_titus_andronicus", "romeo_and_juliet",
             "timon_of_athens", "julius_caesar", "macbeth", "hamlet", "lear", "othello", "antony_and_cleopatra",
             "cymbeline")
# the First Folio's order within each genre; ids of the bundled corpus are these + "_gut"
GENRE_OF = {f"{work}_gut": genre for genre, works in zip(LABELS, (COMEDIES, HISTORIES, TRAGEDIES))
            for work in works}
UNLABELLED = ("pericles_gut", "sonnets_gut", "lovers_complaint_gut", "passionate_pilgrim_gut",
              "phoenix_and_the_turtle_gut", "rape_of_lucrece_gut")
TEST_PER_GENRE, VAL_PER_GENRE = 3, 1
_FIRST_ACT = re.compile(r"(?im)^act\b")  # "ACT I.", "ACT FIRST", "Act 1."


@dataclass(frozen=True)
class Work:
    id: str
    label: int  # index into the label names
    text: str


def play_text(doc: Document) -> str:
    """The play from its first act heading on (no title, no list of persons)."""
    found = _FIRST_ACT.search(doc.text)
    if found is None:
        raise QkvError(f"{doc.id}: no act heading; only plays are labelled")
    return doc.text[found.start():]


def labelled_works() -> list[Work]:
    """Every labelled play of the bundled corpus (modern spelling), in file order."""
    docs = [doc for doc in bundled_documents("modern") if doc.id in GENRE_OF]
    return [Work(doc.id, LABELS.index(GENRE_OF[doc.id]), play_text(doc)) for doc in docs]


def split_works(works: list[Work], test_per_label: int = TEST_PER_GENRE,
                val_per_label: int = VAL_PER_GENRE) -> tuple[list[Work], list[Work], list[Work]]:
    """(train, val, test), stratified by label: per label, works ordered by sha256(id), first test, then val."""
    train, val, test = [], [], []
    for label in sorted({work.label for work in works}):
        group = sorted((w for w in works if w.label == label), key=lambda w: hashlib.sha256(w.id.encode()).digest())
        if len(group) < test_per_label + val_per_label + 1:
            raise QkvError(f"label {label}: {len(group)} works, need {test_per_label + val_per_label + 1} "
                           f"(test, validation and at least one to train on)")
        test += group[:test_per_label]
        val += group[test_per_label:test_per_label + val_per_label]
        train += group[test_per_label + val_per_label:]
    order = {w.id: i for i, w in enumerate(works)}
    return tuple(sorted(part, key=lambda w: order[w.id]) for part in (train, val, test))


def bundled_split() -> tuple[list[Work], list[Work], list[Work]]:
    return split_works(labelled_works())


def held_out_ids() -> set[str]:
    """The plays a genre-split run never trains on (validation and test)."""
    _, val, test = bundled_split()
    return {w.id for w in val + test}


def genre_documents(spelling: str = "modern") -> tuple[list[Document], list[Document]]:
    """data.split=genre for token-stream objectives (MLM pretraining): train on every modern work except the
    genre split's validation and test plays (poems and Pericles included), validate on the validation plays."""
    if spelling != "modern":
        raise QkvError("data.split='genre' uses the modern spelling only (data.spelling='modern')")
    _, val, test = bundled_split()
    held, val_ids = {w.id for w in val + test}, {w.id for w in val}
    docs = bundled_documents("modern")
    return [d for d in docs if d.id not in held], [d for d in docs if d.id in val_ids]


class Passages:
    """Token windows of labelled works. `len()` is the number of tokens (as for a token stream).

    tokens: the works' token ids back to back; bounds: (start, end) of each work in `tokens`;
    labels: each work's label. A work shorter than T tokens gives no window.
    """

    def __init__(self, works_ids: list[np.ndarray], labels: list[int], names: list[str],
                 label_names: tuple[str, ...]):
        lengths = np.asarray([len(ids) for ids in works_ids], dtype=np.int64)  # (W,)
        self.tokens = np.concatenate([np.zeros(0, np.int64), *works_ids]).astype(np.int64)  # (sum of lengths,)
        ends = np.cumsum(lengths)
        self.bounds = np.stack([ends - lengths, ends], axis=1)  # (W, 2)
        self.labels = np.asarray(labels, dtype=np.int64)  # (W,)
        self.names, self.label_names = list(names), tuple(label_names)

    def __len__(self) -> int:
        return len(self.tokens)

    def windows(self, seq_len: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Every non-overlapping window: (ids (N, T), labels (N,), work index (N,)), works in order."""
        starts, works = [], []
        for w, (begin, end) in enumerate(self.bounds):
            count = (end - begin) // seq_len
            starts.append(begin + seq_len * np.arange(count))
            works.append(np.full(count, w))
        starts_all = np.concatenate([np.zeros(0, np.int64), *starts]).astype(np.int64)  # (N,)
        work_all = np.concatenate([np.zeros(0, np.int64), *works]).astype(np.int64)  # (N,)
        ids = self.tokens[starts_all[:, None] + np.arange(seq_len)]  # (N, T)
        return ids, self.labels[work_all], work_all


def encode_works(works: list[Work], tokenizer, label_names: tuple[str, ...] = LABELS) -> Passages:
    ids = tokenizer.encode_batch([w.text for w in works]) if works else []
    return Passages([np.asarray(i, np.int64) for i in ids], [w.label for w in works], [w.id for w in works],
                    label_names)


class PassageBatches:
    """Random training windows: a window start uniform over every position where a window of T tokens fits
    inside one work; `next()` -> (ids (B, T) int64, labels (B,) int64). Reproducible from `seed`, JSON state."""

    def __init__(self, passages: Passages, seq_len: int, batch_size: int, seed: int):
        lengths = passages.bounds[:, 1] - passages.bounds[:, 0] - seq_len + 1  # (W,) window starts per work
        if not (lengths > 0).any():
            raise QkvError(f"no work has {seq_len} tokens: lower train.seq_len")
        self.passages, self.seq_len, self.batch_size = passages, seq_len, batch_size
        self.counts = np.maximum(lengths, 0)
        self.cumulative = np.cumsum(self.counts)  # (W,)
        self._rng = np.random.Generator(np.random.PCG64(seed))
        self.drawn = 0

    def next(self) -> tuple[np.ndarray, np.ndarray]:
        draws = self._rng.integers(0, self.cumulative[-1], size=self.batch_size)  # (B,) over all window starts
        work = np.searchsorted(self.cumulative, draws, side="right")  # (B,)
        offset = draws - (self.cumulative[work] - self.counts[work])
        starts = self.passages.bounds[work, 0] + offset
        self.drawn += 1
        return self.passages.tokens[starts[:, None] + np.arange(self.seq_len)], self.passages.labels[work]

    def state(self) -> dict:
        return {"bit_generator": self._rng.bit_generator.state, "batches": self.drawn, "seq_len": self.seq_len,
                "batch_size": self.batch_size}

    def load_state(self, state: dict) -> None:
        if (state.get("seq_len"), state.get("batch_size")) != (self.seq_len, self.batch_size):
            raise QkvError(f"data state is for seq_len={state.get('seq_len')}, batch_size={state.get('batch_size')}"
                           f"; this run has seq_len={self.seq_len}, batch_size={self.batch_size}")
        self._rng.bit_generator.state = state["bit_generator"]
        self.drawn = int(state["batches"])
