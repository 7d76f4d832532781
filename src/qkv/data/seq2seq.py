"""Sequence-to-sequence pairs from a token stream, for teacher-forced encoder-decoder training
(SPEC B10; note 000 §13.1 applied to p(y | x)).

Lines are the runs of tokens between line breaks: tokens whose bytes contain "\\n" (the byte-level
pre-tokenizer keeps newlines in whitespace-only tokens) and the end-of-text token. A task (`data.seq2seq_task`)
turns line i into a (source, target) pair:
    next-line: line i -> line i + 1;      reverse: line i -> the tokens of line i in reverse order;
    folio:     a line "source<TAB>target" -> (source, target): the separator (a token whose bytes contain
               "\\t") also ends a line, and the pair is line i -> line i + 1 where a separator lies between
               them. The bundled modern -> First Folio pairs (qkv.data.folio, data.split=folio) are such
               lines; so is any text of tab-separated pairs given with --data.

A batch of B pairs drawn uniformly (PCG64, JSON state as `dataset.Batches`):
    src        (B, S)  source ids, right-padded with PAD            src_mask (B, S) 1 = token
    tgt_in     (B, T)  [BOS] + target (BOS = end-of-text)           tgt_mask (B, T)
    labels     (B, T)  target + [EOS], -100 at padding               (teacher forcing: predict labels[t]
                                                                       from tgt_in[:t+1] and the source)
Sources keep their first seq_len tokens and targets their first seq_len - 1.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from qkv.data.tokenizer import PAD, Tokenizer, needs_tokenizer
from qkv.errors import QkvError
from qkv.registry import Registry

IGNORE = -100
Pair = tuple[np.ndarray, np.ndarray]


@dataclass(frozen=True)
class Task:
    """One seq2seq task: which lines start a pair, and the pair of line i."""

    pair: Callable[[np.ndarray, np.ndarray, int], Pair]  # (tokens, spans (N, 2), i) -> (source, target)
    starts: Callable[[np.ndarray, np.ndarray, np.ndarray], np.ndarray]  # (tokens, spans, separator ids) -> (P,) i
    separated: bool = False  # the separator tokens end a line, as line breaks do

    def __call__(self, tokens: np.ndarray, spans: np.ndarray, index: int) -> Pair:
        return self.pair(tokens, spans, index)


SEQ2SEQ_TASKS: Registry[Task] = Registry("seq2seq task")


def line_spans(tokens: np.ndarray, break_ids: Sequence[int]) -> np.ndarray:
    """(N, 2) [start, end) of every non-empty run of tokens between break tokens."""
    breaks = np.flatnonzero(np.isin(tokens, np.asarray(list(break_ids), dtype=np.int64)))
    bounds = np.concatenate(([-1], breaks, [len(tokens)]))
    starts, ends = bounds[:-1] + 1, bounds[1:]
    keep = ends > starts
    return np.stack((starts[keep], ends[keep]), axis=1)


def all_but_last(tokens: np.ndarray, spans: np.ndarray, separator_ids: np.ndarray) -> np.ndarray:
    return np.arange(len(spans) - 1)


def next_line(tokens: np.ndarray, spans: np.ndarray, index: int) -> Pair:
    (a, b), (c, d) = spans[index], spans[index + 1]
    return np.asarray(tokens[a:b], dtype=np.int64), np.asarray(tokens[c:d], dtype=np.int64)


def reverse_line(tokens: np.ndarray, spans: np.ndarray, index: int) -> Pair:
    a, b = spans[index]
    line = np.asarray(tokens[a:b], dtype=np.int64)
    return line, line[::-1].copy()


def before_separator(tokens: np.ndarray, spans: np.ndarray, separator_ids: np.ndarray) -> np.ndarray:
    """The lines that end at a separator token directly followed by the next line."""
    ends = spans[:-1, 1]  # (N - 1,) the token after each line; every line but the last has one
    return np.flatnonzero(np.isin(tokens[ends], separator_ids) & (spans[1:, 0] == ends + 1))


SEQ2SEQ_TASKS.register("next-line")(Task(next_line, all_but_last))
SEQ2SEQ_TASKS.register("reverse")(Task(reverse_line, all_but_last))
SEQ2SEQ_TASKS.register("folio")(Task(next_line, before_separator, separated=True))


def pad_right(rows: Sequence[np.ndarray], fill: int) -> tuple[np.ndarray, np.ndarray]:
    """Rows of different lengths -> (B, L) ids padded with `fill` and the (B, L) mask, 1 = token."""
    width = max(len(row) for row in rows)
    ids = np.full((len(rows), width), fill, dtype=np.int64)
    mask = np.zeros((len(rows), width), dtype=np.int64)
    for i, row in enumerate(rows):
        ids[i, :len(row)] = row
        mask[i, :len(row)] = 1
    return ids, mask


def collate(pairs: Sequence[Pair], *, seq_len: int, bos_id: int, eos_id: int, pad_id: int) -> tuple[np.ndarray, ...]:
    """(src, src_mask, tgt_in, tgt_mask, labels) for a list of (source, target) pairs."""
    sources = [src[:seq_len] for src, _ in pairs]
    targets = [tgt[: seq_len - 1] for _, tgt in pairs]
    src, src_mask = pad_right(sources, pad_id)
    tgt_in, tgt_mask = pad_right([np.concatenate(([bos_id], t)) for t in targets], pad_id)
    labels, _ = pad_right([np.concatenate((t, [eos_id])) for t in targets], IGNORE)
    return src, src_mask, tgt_in, tgt_mask, labels


class Seq2SeqBatches:
    """Random (source, target) pairs of one task over a stream's lines, reproducible and resumable.

    With world > 1 every rank draws the same global batch and keeps rows rank::world."""

    def __init__(self, tokens: np.ndarray, seq_len: int, batch_size: int, seed: int, *, task: str,
                 break_ids: Sequence[int], bos_id: int, eos_id: int, pad_id: int, separator_ids: Sequence[int] = (),
                 rank: int = 0, world: int = 1):
        if seq_len < 2:
            raise QkvError(f"seq2seq needs seq_len >= 2 (BOS + one target token), got {seq_len}")
        self.task, self.make = task, SEQ2SEQ_TASKS.get(task)
        separators = np.asarray(list(separator_ids), dtype=np.int64)
        breaks = [*break_ids, *separators.tolist()] if self.make.separated else break_ids
        self.tokens, self.spans = tokens, line_spans(tokens, breaks)
        if len(self.spans) < 2:
            raise QkvError(f"seq2seq needs at least 2 non-empty lines of text, found {len(self.spans)}")
        self.starts = self.make.starts(tokens, self.spans, separators)  # (P,) line i of every pair
        if not len(self.starts):
            raise QkvError(f"data.seq2seq_task={task!r} finds no pair in the text: it reads lines "
                           f"\"source<TAB>target\" (the bundled modern -> First Folio pairs: data.split=folio)")
        self.seq_len, self.batch_size, self.rank, self.world = seq_len, batch_size, rank, world
        self.special = dict(bos_id=bos_id, eos_id=eos_id, pad_id=pad_id)
        self._rng = np.random.Generator(np.random.PCG64(seed))
        self.drawn = 0

    def next(self) -> tuple[np.ndarray, ...]:
        index = self.starts[self._rng.integers(0, len(self.starts), size=self.batch_size)]  # (B,) line of pair i
        self.drawn += 1
        pairs = [self.make(self.tokens, self.spans, int(i)) for i in index[self.rank :: self.world]]
        return collate(pairs, seq_len=self.seq_len, **self.special)

    def pairs(self, count: int) -> list[Pair]:
        """`count` pairs spread evenly over the text, in order (all of them if there are fewer): for scoring."""
        chosen = self.starts[np.unique(np.linspace(0, len(self.starts) - 1, min(count, len(self.starts))).astype(int))]
        return [self.make(self.tokens, self.spans, int(i)) for i in chosen]

    def state(self) -> dict:
        return {"bit_generator": self._rng.bit_generator.state, "batches": self.drawn, "task": self.task,
                "seq_len": self.seq_len, "batch_size": self.batch_size}

    def load_state(self, state: dict) -> None:
        saved = (state.get("task"), state.get("seq_len"), state.get("batch_size"))
        if saved != (self.task, self.seq_len, self.batch_size):
            raise QkvError(f"data state is for task, seq_len, batch_size = {saved}; this run has "
                           f"{(self.task, self.seq_len, self.batch_size)}")
        self._rng.bit_generator.state = state["bit_generator"]
        self.drawn = int(state["batches"])


def seq2seq_batches(tokens: np.ndarray, tokenizer: Tokenizer | None, cfg, *, batch_size: int,
                    seed: int) -> Seq2SeqBatches:
    """The seq2seq objective's batches of a token stream: line pairs cut at the tokens that hold a line
    break (and, for task folio, a tab), BOS = EOS = the end-of-text token, padding with [PAD]."""
    tokenizer = needs_tokenizer(tokenizer, "seq2seq")
    breaks = [i for i, data in enumerate(tokenizer.token_bytes) if b"\n" in data] + [tokenizer.eos_id]
    separators = [i for i, data in enumerate(tokenizer.token_bytes) if b"\t" in data]  # task folio
    return Seq2SeqBatches(tokens, cfg.train.seq_len, batch_size, seed, task=cfg.data.seq2seq_task,
                          break_ids=breaks, bos_id=tokenizer.eos_id, eos_id=tokenizer.eos_id,
                          pad_id=tokenizer.special_id(PAD), separator_ids=separators)
