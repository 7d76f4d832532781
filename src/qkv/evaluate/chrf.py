"""chrF, the character n-gram F-score (Popović 2015, "chrF: character n-gram F-score for automatic MT
evaluation"), and exact-line accuracy: the figures of a seq2seq run on its held-out pairs.

For each order n = 1..N (N = 6) over the characters of a line with its whitespace removed (as sacrebleu):
    match_n = sum over n-grams g of min(count_hyp(g), count_ref(g))        (clipped matches)
    P_n = match_n / hyp_n,   R_n = match_n / ref_n                          (hyp_n, ref_n: n-grams of each)
Over a set of lines the counts are summed before dividing (corpus level, as sacrebleu). The paper's chrP and
chrR are the arithmetic means of P_n and R_n over the orders, and
    chrF_beta = (1 + beta^2) chrP chrR / (beta^2 chrP + chrR)      x 100,   beta = 2 (recall weighs more).
An order with no n-gram in either the hypotheses or the references (every line shorter than n characters)
is left out of the means; one with n-grams on one side only counts P_n = R_n = 0 (qkv's choice for lines
shorter than six characters, where the paper says nothing). Identical texts score 100, texts without a
common character 0.
"""
from __future__ import annotations

from collections import Counter
from typing import Sequence

ORDER = 6  # N, character n-gram orders 1..6 (Popović 2015)
BETA = 2.0


def ngram_counts(text: str, order: int = ORDER) -> list[Counter]:
    """[Counter of the n-grams of `text` without whitespace for n = 1..order]."""
    chars = "".join(text.split())
    return [Counter(chars[i:i + n] for i in range(len(chars) - n + 1)) for n in range(1, order + 1)]


def statistics(hypothesis: str, reference: str, order: int = ORDER) -> list[tuple[int, int, int]]:
    """[(hyp_n, ref_n, match_n) for n = 1..order] of one line."""
    return [(sum(h.values()), sum(r.values()), sum((h & r).values()))
            for h, r in zip(ngram_counts(hypothesis, order), ngram_counts(reference, order))]


def chrf(hypotheses: Sequence[str], references: Sequence[str], *, order: int = ORDER, beta: float = BETA) -> float:
    """Corpus chrF (0..100) of lines against their references (module docstring)."""
    if len(hypotheses) != len(references):
        raise ValueError(f"{len(hypotheses)} hypotheses but {len(references)} references")
    totals = [[0, 0, 0] for _ in range(order)]
    for hypothesis, reference in zip(hypotheses, references):
        for total, counts in zip(totals, statistics(hypothesis, reference, order)):
            for k in range(3):
                total[k] += counts[k]
    used = [(hyp, ref, match) for hyp, ref, match in totals if hyp or ref]
    if not used:  # nothing but whitespace on both sides: identical
        return 100.0
    precision = sum(match / hyp if hyp else 0.0 for hyp, _, match in used) / len(used)
    recall = sum(match / ref if ref else 0.0 for _, ref, match in used) / len(used)
    if precision + recall == 0:
        return 0.0
    return 100.0 * (1 + beta ** 2) * precision * recall / (beta ** 2 * precision + recall)


def exact(hypotheses: Sequence[str], references: Sequence[str]) -> float:
    """Share of lines equal to their reference, character for character (surrounding whitespace aside)."""
    if len(hypotheses) != len(references):
        raise ValueError(f"{len(hypotheses)} hypotheses but {len(references)} references")
    if not references:
        return 0.0
    return sum(h.strip() == r.strip() for h, r in zip(hypotheses, references)) / len(references)
