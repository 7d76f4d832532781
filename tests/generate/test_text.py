"""The text-level API: stop strings cut the output before the earliest one and end generation at the token that
completes it; streaming prints exactly the returned text, never past a stop string."""
import io
from types import SimpleNamespace

import pytest
import torch

import qkv
from qkv.data.tokenizer import Tokenizer
from qkv.generate.text import generate_text, start_of

PROMPT = "the cat"


@pytest.fixture(scope="module")
def run():
    tokenizer = Tokenizer.train(["the cat sat on the mat.\n\nthe dog ran to the cat.\n" * 20], 300)
    torch.manual_seed(0)
    cfg = qkv.ModelConfig(vocab_size=len(tokenizer.token_bytes), d_model=32, n_heads=4, n_layers=2, d_ff=64,
                          max_seq_len=64, positional="rope", init_std=0.3)
    return SimpleNamespace(model=qkv.build_model(cfg).eval(), tokenizer=tokenizer, stop_ids=(tokenizer.eos_id,))


def text(run, strategy="greedy", stream=None, **kwargs) -> str:
    return generate_text(run, PROMPT, max_new_tokens=24, strategy=strategy, temperature=1.0, top_k=20, top_p=0.9,
                         num_beams=3, seed=5, stream=stream, **kwargs)


def first_unique_substring(continuation: str, length: int, start: int) -> tuple[str, int]:
    """A substring whose first occurrence is at index k >= start."""
    for k in range(start, len(continuation) - length + 1):
        if continuation.find(continuation[k:k + length]) == k:
            return continuation[k:k + length], k
    raise AssertionError(f"no unique substring in {continuation!r}")


def tokens_to_complete(run, free_ids: list[int], stop: str) -> int:
    """The number of new tokens whose decoded text first contains `stop` (the oracle: the full decoder)."""
    return next(n for n in range(1, len(free_ids) + 1) if stop in run.tokenizer.decode(free_ids[:n]))


@pytest.mark.parametrize("strategy", ["greedy", "top-k"])
def test_stop_string_cuts_the_text_and_ends_generation_at_the_completing_token(run, strategy):
    free = text(run, strategy)[len(PROMPT):]
    assert len(free) > 12
    stop, k = first_unique_substring(free, 2, start=4)
    calls = []
    hook = run.model.register_forward_hook(lambda *_: calls.append(1))
    try:
        stream = io.StringIO()
        out = text(run, strategy, stream, stop_strings=(stop,))
    finally:
        hook.remove()
    assert out == PROMPT + free[:k]
    assert stream.getvalue() == out + "\n"
    ids = qkv.generate(run.model, torch.tensor([[run.tokenizer.eos_id] + run.tokenizer.encode(PROMPT)]),
                       max_new_tokens=24, strategy=strategy, top_k=20, seed=5,
                       stop_tokens=(run.tokenizer.eos_id,))[0, 1 + len(run.tokenizer.encode(PROMPT)):]
    assert len(calls) == tokens_to_complete(run, ids.tolist(), stop)  # prefill + one call per further token
    assert len(calls) < 24


def test_the_earliest_of_several_stop_strings_wins_and_absent_ones_change_nothing(run):
    free = text(run)[len(PROMPT):]
    early, k = first_unique_substring(free, 2, start=3)
    late, k_late = first_unique_substring(free, 3, start=k + 3)
    assert text(run, stop_strings=(late, early)) == PROMPT + free[:k]
    assert text(run, stop_strings=("\x00never\x00", "")) == PROMPT + free


def test_beam_search_text_is_cut_after_the_fact_and_streamed(run):
    free = text(run, "beam")[len(PROMPT):]
    stop, k = first_unique_substring(free, 2, start=3)
    stream = io.StringIO()
    assert text(run, "beam", stream, stop_strings=(stop,)) == PROMPT + free[:k]
    assert stream.getvalue() == PROMPT + free[:k] + "\n"  # beam text used to be missing from the stream


def test_streaming_without_stop_strings_streams_token_by_token(run):
    writes = []
    stream = io.StringIO()
    stream.write = lambda piece: writes.append(piece)
    out = text(run, "greedy", stream)
    assert "".join(writes) == out + "\n"
    assert len(writes) > 5  # the prompt, then piece by piece


def test_a_language_model_starts_from_end_of_text_and_the_prompt_or_a_line_break(run):
    """End-of-text alone is seen once a document in training: a small model's guess after it is noise, so an
    empty prompt continues end-of-text + a line break, which is not part of the text. Oracle: argmax with a
    full forward per token from that start."""
    tok = run.tokenizer
    assert start_of(tok, PROMPT) == [tok.eos_id] + tok.encode(PROMPT)
    assert start_of(tok, "") == [tok.eos_id] + tok.encode("\n") and len(start_of(tok, "")) == 2
    ids = start_of(tok, "")
    with torch.no_grad():
        for _ in range(12):
            ids.append(int(run.model(torch.tensor([ids]))[0, -1].argmax()))
    new = ids[2:]  # after the start, up to the first end-of-text (a stop token)
    text = generate_text(run, "", max_new_tokens=12, strategy="greedy", temperature=1.0, top_k=20, top_p=0.9,
                         num_beams=3, seed=5)
    assert text == tok.decode(new[:new.index(tok.eos_id)] if tok.eos_id in new else new)
