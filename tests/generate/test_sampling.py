"""Logit processors against closed forms: kept sets for top-k / top-p / min-p (hypothesis), CTRL's
penalty, and sampled frequencies against the processed softmax (chi-square, seeded)."""
import math

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from qkv.errors import QkvError
from qkv.generate.sampling import (PROCESSORS, STRATEGIES, SamplingParams, SamplingState, argmax, draw,
                                   make_generator, process)

# small integer grids make ties common, which is where the tie rule matters
logit_rows = st.lists(st.integers(-6, 6).map(lambda z: z / 2), min_size=2, max_size=12)


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny tensors: one intra-op thread is faster, and far faster on a shared, loaded machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def state(**params) -> SamplingState:
    return SamplingState(SamplingParams(**params), torch.zeros(1, 0, dtype=torch.long))


def kept(logits: list[float], processor: str, **params) -> set[int]:
    out = PROCESSORS.get(processor)(torch.tensor([logits]), state(**params))[0]
    return {i for i, z in enumerate(out.tolist()) if z != float("-inf")}


def ranked(logits: list[float]) -> list[int]:
    """Token ids by decreasing logit, ties by increasing id: the documented rule."""
    return sorted(range(len(logits)), key=lambda i: (-logits[i], i))


def softmax64(logits: list[float]) -> list[float]:
    top = max(logits)
    weights = [math.exp(z - top) for z in logits]
    return [w / sum(weights) for w in weights]


@settings(max_examples=100, deadline=None)
@given(logits=logit_rows, k=st.integers(1, 14))
def test_top_k_keeps_exactly_the_k_best_ties_to_lower_ids(logits, k):
    assert kept(logits, "top_k", top_k=k) == set(ranked(logits)[:k])


@settings(max_examples=100, deadline=None)
@given(logits=logit_rows, p=st.floats(0.01, 1.0))
def test_top_p_keeps_the_smallest_top_ranked_set_reaching_p(logits, p):
    order, probs = ranked(logits), softmax64(logits)
    totals = [sum(probs[i] for i in order[:n]) for n in range(1, len(order) + 1)]
    assume(all(abs(total - p) > 1e-5 for total in totals))  # float32 vs float64 at the boundary
    n = next((n for n, total in enumerate(totals, 1) if total >= p), len(order))
    assert kept(logits, "top_p", top_p=p) == set(order[:n])


@settings(max_examples=100, deadline=None)
@given(logits=logit_rows, ratio=st.floats(0.0, 1.0))
def test_min_p_keeps_tokens_at_least_ratio_times_the_top_probability(logits, ratio):
    probs = softmax64(logits)
    assume(all(abs(q - ratio * max(probs)) > 1e-6 for q in probs))
    assert kept(logits, "min_p", min_p=ratio) == {i for i, q in enumerate(probs) if q >= ratio * max(probs)}


def test_top_k_and_top_p_never_empty_and_keep_the_tie_with_the_lower_id():
    logits = [1.0, 3.0, 3.0, 3.0, -2.0]
    assert kept(logits, "top_k", top_k=2) == {1, 2}
    assert kept(logits, "top_p", top_p=0.4) == {1, 2}  # each of the three ties holds ~0.33
    assert kept(logits, "top_p", top_p=1e-9) == {1}


def test_temperature_divides_the_logits():
    logits = torch.tensor([[2.0, -1.0, 0.5]])
    torch.testing.assert_close(PROCESSORS.get("temperature")(logits, state(temperature=0.5)), logits * 2)


def test_repetition_penalty_follows_ctrl_on_seen_real_tokens_only():
    logits = torch.tensor([[2.0, -1.0, 4.0, -3.0, 1.0]])
    tokens = torch.tensor([[4, 0, 1, 3]])  # token 4 sits in a padded column
    mask = torch.tensor([[0, 1, 1, 1]])
    st_ = SamplingState(SamplingParams(repetition_penalty=2.0), tokens, mask)
    out = PROCESSORS.get("repetition_penalty")(logits, st_)
    torch.testing.assert_close(out, torch.tensor([[1.0, -2.0, 4.0, -6.0, 1.0]]))


def test_argmax_breaks_ties_to_the_lowest_id():
    assert argmax(torch.tensor([[0.0, 5.0, 5.0, 1.0], [7.0, 7.0, 7.0, 7.0]])).tolist() == [1, 0]


@pytest.mark.parametrize("vocab", [8 * 1024, 262_144, 49_152 + 1])  # (by blocks; Gemma 3's; not whole blocks)
def test_argmax_of_a_long_row_is_torchs(vocab):
    """By blocks: torch.argmax's token for each row, whether the maximum is repeated within a block, across
    blocks, in a block's first or last logit, everywhere (-inf), or a NaN's."""
    generator = torch.Generator().manual_seed(vocab)
    logits = torch.randn(8, vocab, generator=generator)
    logits[1, [1023, 1024, 5000]] = 9.0  # the first of three, at a block's end
    logits[2, [2048, 2049]] = 9.0  # a block's first logit
    logits[3] = float("-inf")
    logits[4, [7, 3000]] = float("nan")
    logits[5, vocab - 1] = 9.0
    logits[6, [4096, 4097, 3072]] = 9.0
    logits = logits.to(torch.bfloat16)[:7].float()  # (rounded: more ties)
    assert argmax(logits).tolist() == logits.argmax(dim=-1).tolist()


def chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's chi-square goodness of fit over the tokens with p > 0; sf via the regularised gamma."""
    support = probs > 0
    expected = probs[support] * counts.sum()
    statistic = ((counts[support] - expected) ** 2 / expected).sum()
    dof = torch.tensor(float(support.sum() - 1), dtype=torch.float64)
    return float(torch.special.gammaincc(dof / 2, statistic / 2))


LOGITS = torch.tensor([1.5, 0.3, -0.7, 2.2, 0.0, -2.5, 1.1, 0.8], dtype=torch.float64)


def expected_probs(strategy: str) -> torch.Tensor:
    """The closed form of each strategy's distribution over LOGITS (temperature 0.8, k 3, p 0.7)."""
    probs = (LOGITS / 0.8).softmax(-1)  # float64; LOGITS has no ties
    order = probs.argsort(descending=True)
    ranked_probs = probs[order]
    keep_ranked = {"sample": torch.ones(len(LOGITS), dtype=torch.bool),
                   "top-k": torch.arange(len(LOGITS)) < 3,
                   "top-p": ranked_probs.cumsum(-1) - ranked_probs < 0.7}[strategy]
    keep = torch.zeros_like(keep_ranked)
    keep[order] = keep_ranked
    probs = torch.where(keep, probs, 0.0)
    return probs / probs.sum()


@pytest.mark.parametrize("strategy", ["sample", "top-k", "top-p"])
def test_sampled_frequencies_match_the_processed_softmax(strategy):
    draws = 40_000
    params = SamplingParams(temperature=0.8, top_k=3, top_p=0.7)
    logits = LOGITS.float().expand(draws, -1)  # one row per draw: every row independent
    chosen = STRATEGIES.get(strategy)
    processed = process(logits, SamplingState(params, torch.zeros(draws, 0, dtype=torch.long)), chosen.processors)
    tokens = chosen.choose(processed, make_generator(1234, "cpu"))
    counts = torch.bincount(tokens, minlength=len(LOGITS)).double()
    probs = expected_probs(strategy)
    assert counts[probs == 0].sum() == 0  # removed tokens are never drawn
    assert chi_square_p_value(counts, probs) > 1e-4


def test_chi_square_check_rejects_a_wrong_temperature():
    """The statistical test has power: draws at temperature 1 fail against the tau = 0.8 law."""
    tokens = draw(LOGITS.float().expand(40_000, -1), make_generator(1234, "cpu"))
    counts = torch.bincount(tokens, minlength=len(LOGITS)).double()
    assert chi_square_p_value(counts, expected_probs("sample")) < 1e-4


def test_draws_reproduce_with_a_seed():
    logits = torch.zeros(4, 50)
    first = draw(logits, make_generator(7, "cpu"))
    assert torch.equal(first, draw(logits, make_generator(7, "cpu")))
    assert not torch.equal(first, draw(logits, make_generator(8, "cpu")))


@pytest.mark.parametrize("field, value", [("temperature", 0.0), ("top_k", 0), ("top_p", 0.0), ("top_p", 1.5),
                                          ("min_p", -0.1), ("repetition_penalty", 0.0)])
def test_bad_parameters_name_the_field(field, value):
    with pytest.raises(QkvError, match=field):
        SamplingParams(**{field: value}).validate()


def test_top_k_and_top_p_together_keep_what_both_keep():
    """transformers' order: top-k first, then the nucleus of what is left (renormalised). Oracle by hand."""
    from qkv.generate.sampling import STRATEGIES, SamplingParams, SamplingState, process

    logits = torch.log(torch.tensor([[0.30, 0.25, 0.20, 0.15, 0.10]]))
    state = SamplingState(SamplingParams(top_k=3, top_p=0.6), torch.zeros(1, 1, dtype=torch.long))
    kept = torch.isfinite(process(logits, state, STRATEGIES.get("top-k-top-p").processors))[0].tolist()
    # top-3: 0.30, 0.25, 0.20 -> renormalised 0.40, 0.33, 0.27; the nucleus of 0.6 needs the first two
    assert kept == [True, True, False, False, False]
    alone = torch.isfinite(process(logits, state, STRATEGIES.get("top-p").processors))[0].tolist()
    assert alone == [True, True, True, False, False]  # top-p alone: 0.30 + 0.25 < 0.6 needs the third
