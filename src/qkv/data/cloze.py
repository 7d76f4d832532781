"""Next-line tasks from the bundled plays (docs/finetune.md): what adapting a model to Shakespeare changed.

- `cloze_rows`: the multiple-choice task `qkv eval RUN --task shakespeare-cloze` (qkv.evaluate.choice): three
  lines of a held-out play, then four candidate next lines (the true one and three others from the same play),
  scored by log-likelihood. Chance is 0.25.
- `preference_pairs`: DPO rows (qkv.train.dpo): the same three lines as the prompt, the true next line chosen and
  a line of another play rejected.

Lines are the plays' verse and prose lines, stripped, with at least MIN_LETTERS letters and not a speaker's name
or stage direction in capitals. Everything is drawn with a fixed seed: the same rows on every machine.
"""
from __future__ import annotations

import random

from qkv.data.corpus import bundled_split

MIN_LETTERS = 12
CONTEXT_LINES = 3
NOT_PLAYS = ("sonnets_gut",)  # a held-out work (qkv.data.corpus.VALIDATION_WORKS) without dialogue


def play_lines(text: str) -> list[str]:
    lines = []
    for line in text.split("\n"):
        line = " ".join(line.split())
        letters = [c for c in line if c.isalpha()]
        if len(letters) >= MIN_LETTERS and not all(c.isupper() for c in letters):
            lines.append(line)
    return lines


def plays(held_out: bool) -> dict[str, list[str]]:
    """{work id: its lines} of the held-out plays (VALIDATION_WORKS) or of the training ones."""
    train, val = bundled_split("modern")
    works = val if held_out else train
    return {doc.id: play_lines(doc.text) for doc in works if doc.id not in NOT_PLAYS and len(play_lines(doc.text)) > 50}


def _passage(rng: random.Random, lines: list[str]) -> tuple[str, str, int]:
    i = rng.randrange(CONTEXT_LINES, len(lines))
    return "\n".join(lines[i - CONTEXT_LINES:i]) + "\n", lines[i], i


def cloze_rows(count: int = 400, seed: int = 0) -> list[dict]:
    """{"context", "choices", "gold"} rows over the held-out plays, in turn."""
    rng, works = random.Random(seed), plays(held_out=True)
    names = sorted(works)
    rows = []
    for k in range(count):
        lines = works[names[k % len(names)]]
        context, true, i = _passage(rng, lines)
        others = set()
        while len(others) < 3:
            j = rng.randrange(len(lines))
            if abs(j - i) > CONTEXT_LINES and lines[j] != true:
                others.add(lines[j])
        choices = sorted(others) + [true]
        rng.shuffle(choices)
        rows.append({"context": context, "choices": choices, "gold": choices.index(true)})
    return rows


def preference_pairs(count: int, *, held_out: bool, seed: int = 0) -> list[dict]:
    """{"prompt", "chosen", "rejected"} rows: the true next line over a line of another play."""
    rng, works = random.Random(seed), plays(held_out=held_out)
    names = sorted(works)
    rows = []
    for k in range(count):
        name = names[k % len(names)]
        context, true, _ = _passage(rng, works[name])
        other = works[rng.choice([n for n in names if n != name])]
        rows.append({"prompt": context, "chosen": true, "rejected": other[rng.randrange(len(other))]})
    return rows

