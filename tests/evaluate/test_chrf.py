"""chrF (Popović 2015; qkv.evaluate.chrf) against values computed by hand from its definition, and its properties;
exact-line accuracy."""
import random

import pytest

from qkv.evaluate.chrf import chrf, exact, statistics


def f_beta(p: float, r: float, beta: float = 2.0) -> float:
    return 100 * (1 + beta ** 2) * p * r / (beta ** 2 * p + r)


def test_statistics_count_clipped_ngrams_without_whitespace():
    # "a a b" -> "aab": unigrams a, a, b; bigrams aa, ab; trigram aab. Reference "ab": a, b; ab.
    assert statistics("a a b", "ab", order=3) == [(3, 2, 2), (2, 1, 1), (1, 0, 0)]


def test_hand_computed_values():
    # "ab" vs "ac": n=1 P = R = 1/2; n=2 P = R = 0; orders 3-6 have no n-grams on either side and are left out
    assert chrf(["ab"], ["ac"]) == pytest.approx(f_beta(0.25, 0.25))  # 25.0
    # "a" vs "ab": n=1 P = 1, R = 1/2; n=2 the hypothesis has none: P = R = 0 -> chrP = 1/2, chrR = 1/4
    assert chrf(["a"], ["ab"]) == pytest.approx(f_beta(0.5, 0.25))  # 27.78
    # swapped: chrP = 1/4, chrR = 1/2; beta = 2 favours recall, so the longer hypothesis scores higher
    assert chrf(["ab"], ["a"]) == pytest.approx(f_beta(0.25, 0.5))  # 41.67
    assert chrf(["ab"], ["a"]) > chrf(["a"], ["ab"])
    # "abcabc" vs "abc": n=1 P=3/6 R=1; n=2 P=2/5 R=1; n=3 P=1/4 R=1; n=4..6 reference has none: P = R = 0
    p, r = (1 / 2 + 2 / 5 + 1 / 4) / 6, 3 / 6
    assert chrf(["abcabc"], ["abc"]) == pytest.approx(f_beta(p, r))


def test_corpus_level_pools_the_counts_of_all_lines():
    # line 1 "ab"/"ab": (2,2,2), (1,1,1); line 2 "x"/"y": (1,1,0). Pooled: n=1 3 hyp, 3 ref, 2 match; n=2 1/1/1
    assert chrf(["ab", "x"], ["ab", "y"]) == pytest.approx(f_beta((2 / 3 + 1) / 2, (2 / 3 + 1) / 2))
    mean_of_lines = (chrf(["ab"], ["ab"]) + chrf(["x"], ["y"])) / 2
    assert chrf(["ab", "x"], ["ab", "y"]) != pytest.approx(mean_of_lines)


def test_properties():
    rng = random.Random(0)
    lines = ["".join(rng.choice("abcde ") for _ in range(rng.randint(1, 30))) for _ in range(20)]
    others = ["".join(rng.choice("abcde ") for _ in range(rng.randint(1, 30))) for _ in range(20)]
    assert chrf(lines, lines) == pytest.approx(100.0)  # identity
    assert chrf(["abc def"], ["abcdef"]) == pytest.approx(100.0)  # whitespace is ignored
    assert chrf(["abc"], ["xyz"]) == 0.0  # no common character
    assert 0.0 <= chrf(lines, others) <= 100.0
    # with beta = 1 the F-score is symmetric in hypothesis and reference
    assert chrf(lines, others, beta=1.0) == pytest.approx(chrf(others, lines, beta=1.0))
    assert chrf(lines, others) != pytest.approx(chrf(others, lines))
    # the order of the lines does not matter at corpus level; one more right line raises the score
    order = list(range(20))
    rng.shuffle(order)
    assert chrf([lines[i] for i in order], [others[i] for i in order]) == pytest.approx(chrf(lines, others))
    assert chrf(lines + ["abcdefg"], others + ["abcdefg"]) > chrf(lines, others)


def test_exact_accuracy():
    assert exact(["To be", "or not ", "to be"], ["To be", "or not", "To be"]) == pytest.approx(2 / 3)
    assert exact([], []) == 0.0
    with pytest.raises(ValueError):
        chrf(["a"], [])
