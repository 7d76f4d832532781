"""Modern spelling -> First Folio spelling: the bundled corpus's 35 works in both spellings, aligned line by
line into (modern, Folio) pairs for the encoder-decoder (note 003: encoder-decoders translate; docs/tasks.md
"Modern to First Folio").

Alignment of one work, in three steps (difflib does the sequence matching):
1. Lines. Folio speeches open with an indented speaker prefix ("   Ham. To be, or not to be") that the
   modern text prints on a line of its own ("HAMLET."): the prefix is cut (FOLIO_SPEAKER). Both sides are
   stripped; a line with fewer than MIN_LETTERS letters (speaker names, "Exit.", blank lines) takes no part.
2. Anchors. Each line gets a spelling-blind key: lowercase letters only, long s -> s, v -> u, j -> i
   (the Folio prints "Vpon", "reuolt", "Iustice"), then the vowels (and y) removed and repeated letters
   collapsed, so "againe"/"again", "Sunne"/"sun", "supply'd"/"supplied" share a key.
   difflib.SequenceMatcher over the two lists of keys gives the in-order runs of equal keys.
3. Gaps. Between two runs, the lines of both sides are paired in order by maximising the summed
   similarity (a small monotone alignment, only where both sides have at most MAX_GAP lines).
A candidate pair is kept when the similarity of its folded letters (u/v, i/j, long s, lowercase, letters
only; SequenceMatcher.ratio, 2 * matches / total) is at least THRESHOLD, which drops modern lines that
an editor re-wrapped or emended and the Folio's different stage directions.

A pair is written as one line "modern<TAB>folio" (no line of the corpus contains a tab): one document per
work, so the stream's tokenizer is trained on both spellings and `qkv.data.seq2seq`'s task "folio" cuts
each line at the tab. Works are split whole: the Folio twins of the corpus's held-out works
(HELD_OUT: Hamlet, Julius Caesar, The Tempest, Twelfth Night) are the validation set.
"""
from __future__ import annotations

import dataclasses
import difflib
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from qkv.data.corpus import VALIDATION_WORKS, Document, bundled_documents, content_hash
from qkv.data.dataset import default_cache_dir

ALIGNMENT_VERSION = "1"  # bump when the alignment changes in a way its settings below do not show
SEPARATOR = "\t"
THRESHOLD = 0.85  # folded-letter similarity a kept pair reaches at least
MIN_LETTERS = 4  # shorter lines (speaker names, "Exit.") are not aligned
MAX_GAP = 40  # gaps between anchors with more lines than this on either side are left unaligned

# modern id -> its First Folio twin (the Folio titles differ: "Twelfe-Night", "Loves Labour Lost", ...)
TWINS = {
    "alls_well_that_ends_well_gut": "all_is_well_that_ends_well_gut_f",
    "antony_and_cleopatra_gut": "anthonie_and_cleopatra_gut_f",
    "as_you_like_it_gut": "as_you_like_it_gut_f",
    "comedy_of_errors_gut": "comedy_of_errours_gut_f",
    "coriolanus_gut": "coriolanus_gut_f",
    "cymbeline_gut": "cymbeline_gut_f",
    "hamlet_gut": "hamlet_gut_f",
    "henry_iv_part_1_gut": "henry_iv_part_1_gut_f",
    "henry_iv_part_2_gut": "henry_iv_part_2_gut_f",
    "henry_v_gut": "henry_v_gut_f",
    "henry_vi_part_1_gut": "henry_vi_part_1_gut_f",
    "henry_vi_part_2_gut": "henry_vi_part_2_gut_f",
    "henry_vi_part_3_gut": "henry_vi_part_3_gut_f",
    "henry_viii_gut": "henry_viii_gut_f",
    "john_gut": "john_gut_f",
    "julius_caesar_gut": "julius_caesar_gut_f",
    "lear_gut": "lear_gut_f",
    "loves_labours_lost_gut": "loves_labour_lost_gut_f",
    "macbeth_gut": "macbeth_gut_f",
    "measure_for_measure_gut": "measure_for_measure_gut_f",
    "merchant_of_venice_gut": "merchant_of_venice_gut_f",
    "merry_wives_of_windsor_gut": "merry_wives_of_windsor_gut_f",
    "midsummer_nights_dream_gut": "midsummer_nights_dreame_gut_f",
    "much_ado_about_nothing_gut": "much_ado_about_nothing_gut_f",
    "othello_gut": "othello_gut_f",
    "richard_ii_gut": "richard_ii_gut_f",
    "richard_iii_gut": "richard_iii_gut_f",
    "romeo_and_juliet_gut": "romeo_and_juliet_gut_f",
    "taming_of_the_shrew_gut": "taming_of_the_shrew_gut_f",
    "tempest_gut": "tempest_gut_f",
    "timon_of_athens_gut": "timon_of_athens_gut_f",
    "tragedy_of_titus_andronicus_gut": "titus_andronicus_gut_f",
    "twelfth_night_gut": "twelfe-night_gut_f",
    "two_gentlemen_of_verona_gut": "two_gentlemen_of_verona_gut_f",
    "winters_tale_gut": "winters_tale_gut_f",
}
HELD_OUT = tuple(work for work in VALIDATION_WORKS if work in TWINS)  # the Sonnets are not in the Folio

# an indented speaker prefix: "  1. ", "   Ham. ", "   Lady M. " (up to its first period)
FOLIO_SPEAKER = re.compile(r"^ {2,}[^\s.][^.]{0,24}?\.\s+(?=\S)")
_FOLD = str.maketrans({"ſ": "s", "v": "u", "j": "i"})
_NOT_LETTER = re.compile(r"[^a-z]+")
_VOWELS = re.compile(r"[aeiouy]+")
_REPEATS = re.compile(r"(.)\1+")


def fold(line: str) -> str:
    """Lowercase letters only, long s -> s, v -> u, j -> i: what the similarity compares."""
    return _NOT_LETTER.sub("", line.lower().translate(_FOLD))


def key(line: str) -> str:
    """The spelling-blind anchor key: fold, drop the vowels and y, collapse repeated letters."""
    return _REPEATS.sub(r"\1", _VOWELS.sub("", fold(line)))


def similarity(a: str, b: str) -> float:
    """2 * matching characters / total characters of the two folded lines (difflib's ratio), in [0, 1]."""
    return difflib.SequenceMatcher(None, fold(a), fold(b), autojunk=False).ratio()


def similarities(a: Sequence[str], b: Sequence[str]) -> list[list[float]]:
    """(len(a), len(b)) similarities of folded lines, 0 where difflib's cheap upper bounds (length, then
    letter counts) already fall below THRESHOLD."""
    matcher = difflib.SequenceMatcher(None, autojunk=False)
    rows = [[0.0] * len(b) for _ in a]
    for j, y in enumerate(b):
        matcher.set_seq2(y)  # difflib caches its index of the second sequence
        for i, x in enumerate(a):
            matcher.set_seq1(x)
            if matcher.real_quick_ratio() >= THRESHOLD and matcher.quick_ratio() >= THRESHOLD:
                rows[i][j] = matcher.ratio()
    return rows


def usable_lines(text: str, *, folio: bool) -> list[str]:
    """The lines that take part in the alignment, stripped (and cut of their speaker prefix in the Folio)."""
    lines = []
    for line in text.split("\n"):
        if folio:
            line = FOLIO_SPEAKER.sub("", line)
        line = " ".join(line.split())
        if len(fold(line)) >= MIN_LETTERS:
            lines.append(line)
    return lines


def gap_pairs(a: Sequence[str], b: Sequence[str]) -> list[tuple[int, int]]:
    """The in-order pairing of two gaps' folded lines with the largest summed similarity, over pairs that
    reach THRESHOLD (a monotone alignment, as edit distance with free insertions and deletions)."""
    n, m = len(a), len(b)
    score = similarities(a, b)
    best = [[0.0] * (m + 1) for _ in range(n + 1)]  # best[i][j]: a[:i] against b[:j]
    for i in range(1, n + 1):
        for j in range(1, m + 1):
            take = best[i - 1][j - 1] + score[i - 1][j - 1] if score[i - 1][j - 1] >= THRESHOLD else -1.0
            best[i][j] = max(best[i - 1][j], best[i][j - 1], take)
    pairs, i, j = [], n, m
    while i and j:
        if best[i][j] == best[i - 1][j]:
            i -= 1
        elif best[i][j] == best[i][j - 1]:
            j -= 1
        else:
            pairs.append((i - 1, j - 1))
            i, j = i - 1, j - 1
    return pairs[::-1]


def align_lines(modern: Sequence[str], folio: Sequence[str]) -> list[tuple[str, str]]:
    """(modern line, Folio line) pairs of two works' usable lines, in order (module docstring)."""
    folded_a, folded_b = [fold(x) for x in modern], [fold(y) for y in folio]
    keys_a, keys_b = [key(x) for x in modern], [key(y) for y in folio]
    candidates = []
    for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(None, keys_a, keys_b, autojunk=False).get_opcodes():
        if tag == "equal":
            candidates += [(i, j) for i, j in zip(range(i1, i2), range(j1, j2))
                           if similarities([folded_a[i]], [folded_b[j]])[0][0] >= THRESHOLD]
        elif tag == "replace" and i2 - i1 <= MAX_GAP and j2 - j1 <= MAX_GAP:
            candidates += [(i1 + i, j1 + j) for i, j in gap_pairs(folded_a[i1:i2], folded_b[j1:j2])]
    return [(modern[i], folio[j]) for i, j in candidates]


@dataclass(frozen=True)
class AlignedWork:
    modern_id: str
    folio_id: str
    title: str
    modern_lines: int  # usable lines on each side
    folio_lines: int
    pairs: tuple[tuple[str, str], ...]

    def document(self) -> Document:
        """The work's pairs as one document of "modern<TAB>folio" lines."""
        text = "\n".join(f"{modern}{SEPARATOR}{folio}" for modern, folio in self.pairs)
        return Document(id=f"{self.modern_id}+folio", text=text, title=self.title, spelling="modern+first-folio")


def align_work(modern: Document, folio: Document) -> AlignedWork:
    modern_lines, folio_lines = usable_lines(modern.text, folio=False), usable_lines(folio.text, folio=True)
    pairs = align_lines(modern_lines, folio_lines)
    return AlignedWork(modern.id, folio.id, modern.title, len(modern_lines), len(folio_lines), tuple(pairs))


def aligned_works(cache_dir: Path | None = None) -> tuple[AlignedWork, ...]:
    """Every bundled work with a Folio twin, aligned, in the modern corpus's order. The result is kept as
    JSON in the cache folder, keyed by the texts and the alignment's settings (aligning takes seconds)."""
    folio = {doc.id: doc for doc in bundled_documents("first-folio")}
    twins = [(doc, folio[TWINS[doc.id]]) for doc in bundled_documents("modern") if doc.id in TWINS]
    settings = json.dumps([ALIGNMENT_VERSION, THRESHOLD, MIN_LETTERS, MAX_GAP, FOLIO_SPEAKER.pattern])
    digest = content_hash([text for pair in twins for text in (pair[0].text, pair[1].text)], settings)
    path = Path(cache_dir or default_cache_dir()) / f"folio-{digest[:32]}.json"
    if path not in _ALIGNED:
        _ALIGNED[path] = _read(path) or _write(path, tuple(align_work(modern, folio) for modern, folio in twins))
    return _ALIGNED[path]


_ALIGNED: dict[Path, tuple[AlignedWork, ...]] = {}  # this process's alignments, by cache file


def _read(path: Path) -> tuple[AlignedWork, ...] | None:
    try:
        rows = json.loads(path.read_text(encoding="utf-8"))
        return tuple(AlignedWork(**{**row, "pairs": tuple(map(tuple, row["pairs"]))}) for row in rows)
    except (OSError, ValueError, TypeError, KeyError):  # absent or unreadable: align again
        return None


def _write(path: Path, works: tuple[AlignedWork, ...]) -> tuple[AlignedWork, ...]:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps([dataclasses.asdict(work) for work in works]), encoding="utf-8")
    os.replace(tmp, path)  # atomic: a reader sees the whole file or none
    return works


def folio_split() -> tuple[list[Document], list[Document]]:
    """(train, validation) pair documents, whole works: the works of HELD_OUT are the validation set."""
    works = aligned_works()
    return ([w.document() for w in works if w.modern_id not in HELD_OUT],
            [w.document() for w in works if w.modern_id in HELD_OUT])


def report() -> list[dict]:
    """Per work: usable lines on each side and aligned pairs, and whether it is held out."""
    return [{"work": w.title, "modern_lines": w.modern_lines, "folio_lines": w.folio_lines,
             "pairs": len(w.pairs), "held_out": w.modern_id in HELD_OUT} for w in aligned_works()]
