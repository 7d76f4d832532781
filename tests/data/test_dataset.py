import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from qkv.data.corpus import bundled_documents, join
from qkv.data.dataset import (
    Batches,
    chunk_text,
    default_cache_dir,
    encode_stream,
    eval_windows,
    prepare,
    read_tokens,
    write_tokens,
)
from qkv.data.tokenizer import Tokenizer
from qkv.errors import QkvError


@pytest.fixture(scope="module")
def sample_text():
    return join(bundled_documents("modern")[:2])  # about 270k characters of real text


@pytest.fixture(scope="module")
def sample_tok(sample_text):
    return Tokenizer.train([sample_text], vocab_size=600)


# ------------------------------------------------------------------------------------------ token files


@pytest.mark.parametrize("vocab_size, dtype", [(300, np.uint16), (65536, np.uint16), (65537, np.uint32)])
def test_token_file_dtype_and_round_trip(tmp_path, vocab_size, dtype):
    ids = np.array([0, 1, vocab_size - 1, 7, vocab_size // 2], dtype=np.int64)
    path = tmp_path / "t.bin"
    write_tokens(path, ids, vocab_size)
    tokens = read_tokens(path)
    assert isinstance(tokens, np.memmap) and tokens.dtype == dtype
    np.testing.assert_array_equal(tokens, ids)
    assert path.stat().st_size == ids.size * np.dtype(dtype).itemsize
    assert json.loads((tmp_path / "t.bin.json").read_text())["length"] == 5
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.bin", "t.bin.json"]  # no temp files left


def test_token_file_rejects_ids_outside_vocab(tmp_path):
    with pytest.raises(ValueError, match=r"\[0, 300\)"):
        write_tokens(tmp_path / "t.bin", np.array([0, 300]), 300)


def test_token_file_errors(tmp_path):
    path = tmp_path / "t.bin"
    with pytest.raises(QkvError, match="t.bin.json: token file description not found"):
        read_tokens(path)
    write_tokens(path, np.arange(10), 300)
    (tmp_path / "t.bin.json").write_text('{"dtype": "uint16", "length": 11}')
    with pytest.raises(QkvError, match="expected 22 bytes \\(11 tokens\\), found 20"):
        read_tokens(path)
    (tmp_path / "t.bin.json").write_text("{garbage")
    with pytest.raises(QkvError, match="corrupt"):
        read_tokens(path)


# ------------------------------------------------------------------------------------------ chunking


def test_chunked_encoding_equals_whole_on_real_text(sample_text, sample_tok):
    chunks = chunk_text(sample_text, chunk_chars=10_000)
    assert len(chunks) > 20 and "".join(chunks) == sample_text
    chunked = [i for piece in sample_tok.encode_batch(chunks) for i in piece]
    assert chunked == sample_tok.encode(sample_text)


PIECES = ["a", "b", " ", "  ", "\n", "\n\n", "\r", "\t", "'s", "1", "!", "é", "😀"]


@settings(max_examples=150, deadline=None)
@given(st.lists(st.sampled_from(PIECES)).map("".join))
def test_chunked_encoding_equals_whole_on_any_text(sample_tok, text):
    chunks = chunk_text(text, chunk_chars=3)
    assert "".join(chunks) == text
    assert [i for piece in sample_tok.encode_batch(chunks) for i in piece] == sample_tok.encode(text)


def test_a_naive_cut_after_newline_would_change_the_tokens(sample_tok):
    text = "x\n\nY"  # why chunk_text only cuts between two non-space characters
    assert chunk_text(text, chunk_chars=1) == [text]
    naive = sample_tok.encode("x\n\n") + sample_tok.encode("Y")  # "\n\n" is one token at the end of a chunk
    assert naive != sample_tok.encode(text)


# ------------------------------------------------------------------------------------------ prepare + cache

TRAIN = ["the cat sat on the mat\n" * 30, "the dog sat on the log\n" * 30]
VAL = ["zebra zebra zebra\n" * 10]


def test_prepare_streams_start_with_eos_and_use_training_text_only(tmp_path):
    prepared = prepare(TRAIN, VAL, 300, tmp_path)
    tok = prepared.tokenizer
    assert tok.to_str() == Tokenizer.train(chunk_text(join(TRAIN)), 300).to_str()
    assert prepared.train.dtype == np.uint16
    np.testing.assert_array_equal(prepared.train, [tok.eos_id, *tok.encode(join(TRAIN))])
    np.testing.assert_array_equal(prepared.val, [tok.eos_id, *tok.encode(VAL[0])])
    assert prepared.val_chars == len(VAL[0]) == 180
    assert len(tok.encode(" zebra")) > 1  # never trained on the validation words
    assert prepared.cache_dir.parent == tmp_path


def test_prepare_second_call_hits_the_cache(tmp_path, monkeypatch):
    first = prepare(TRAIN, VAL, 300, tmp_path)

    def fail(*args, **kwargs):
        raise AssertionError("cache miss: retrained or retokenized")

    monkeypatch.setattr(Tokenizer, "train", fail)
    monkeypatch.setattr(Tokenizer, "encode_batch", fail)
    second = prepare(TRAIN, VAL, 300, tmp_path)
    assert second.cache_dir == first.cache_dir
    np.testing.assert_array_equal(second.train, first.train)
    np.testing.assert_array_equal(second.val, first.val)
    assert second.tokenizer.to_str() == first.tokenizer.to_str() and second.val_chars == first.val_chars
    for changed in ((TRAIN, VAL, 301), (TRAIN[:1], TRAIN[1:] + VAL, 300), (TRAIN, ["other"], 300)):
        with pytest.raises(AssertionError, match="cache miss"):  # other content or split -> other entry
            prepare(*changed, tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == [first.cache_dir.name]  # failed builds leave nothing


def test_encode_stream_matches_prepare_rule(sample_tok):
    texts = ["one", "two\n"]
    expected = [sample_tok.eos_id, *sample_tok.encode("one\n\ntwo\n")]
    np.testing.assert_array_equal(encode_stream(sample_tok, texts), expected)


def test_default_cache_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("QKV_CACHE", str(tmp_path))
    assert default_cache_dir() == tmp_path
    monkeypatch.delenv("QKV_CACHE")
    assert default_cache_dir().parts[-2:] == (".cache", "qkv")


# ------------------------------------------------------------------------------------------ batches


def test_batches_are_shifted_windows_at_uniform_offsets():
    tokens = np.arange(20, dtype=np.uint16)  # token value == position
    batches = Batches(tokens, seq_len=4, batch_size=8, seed=0)
    starts = []
    for _ in range(200):
        inputs, targets = batches.next()
        assert inputs.dtype == targets.dtype == np.int64 and inputs.shape == (8, 4)
        np.testing.assert_array_equal(targets, inputs + 1)
        np.testing.assert_array_equal(inputs, inputs[:, :1] + np.arange(4))
        starts.extend(inputs[:, 0])
    assert set(starts) == set(range(16))  # every offset in [0, len - seq_len - 1], no other
    assert abs(np.bincount(starts).std() / np.mean(np.bincount(starts))) < 0.15


def test_batches_are_deterministic_and_seeded():
    tokens = np.arange(1000)
    a, b, c = (Batches(tokens, 8, 4, seed) for seed in (1, 1, 2))
    first, again, other = a.next()[0], b.next()[0], c.next()[0]
    np.testing.assert_array_equal(first, again)
    assert not np.array_equal(first, other)


def test_batches_resume_equals_uninterrupted():
    tokens = np.arange(5000)
    straight = Batches(tokens, 16, 4, seed=3)
    expected = [straight.next()[0] for _ in range(8)]
    interrupted = Batches(tokens, 16, 4, seed=3)
    for _ in range(3):
        interrupted.next()
    state = json.loads(json.dumps(interrupted.state()))  # survives a JSON file
    assert state["batches"] == 3
    resumed = Batches(tokens, 16, 4, seed=999)
    resumed.load_state(state)
    for want in expected[3:]:
        np.testing.assert_array_equal(resumed.next()[0], want)
    assert resumed.state()["batches"] == 8


def test_load_state_rejects_other_shapes():
    state = Batches(np.arange(100), 8, 4, seed=0).state()
    with pytest.raises(QkvError, match="seq_len=8, batch_size=4.*seq_len=16"):
        Batches(np.arange(100), 16, 4, seed=0).load_state(state)


def test_shards_are_disjoint_and_cover_the_global_batch():
    tokens = np.arange(10_000)
    whole = Batches(tokens, 8, 6, seed=5)
    shards = [Batches(tokens, 8, 6, seed=5, rank=r, world=3) for r in range(3)]
    for _ in range(3):
        inputs, targets = whole.next()
        parts = [shard.next() for shard in shards]
        for rank, (shard_inputs, shard_targets) in enumerate(parts):
            np.testing.assert_array_equal(shard_inputs, inputs[rank::3])
            np.testing.assert_array_equal(shard_targets, targets[rank::3])
        rows = np.concatenate([p[0] for p in parts])
        assert len(rows) == 6 and sorted(map(tuple, rows)) == sorted(map(tuple, inputs))


def test_batches_errors():
    with pytest.raises(QkvError, match="5 tokens, but seq_len=4 needs more than 5"):
        Batches(np.arange(5), seq_len=4, batch_size=2, seed=0)
    with pytest.raises(QkvError, match="batch_size=5 must split evenly over world=2"):
        Batches(np.arange(100), seq_len=4, batch_size=5, seed=0, world=2)


# ------------------------------------------------------------------------------------------ eval windows


@settings(max_examples=100, deadline=None)
@given(n=st.integers(2, 60), seq_len=st.integers(1, 12), data=st.data())
def test_eval_windows_score_every_token_once(n, seq_len, data):
    stride = data.draw(st.integers(1, seq_len))
    tokens = np.arange(n)  # token value == position
    scored = []
    for inputs, targets, score_from in eval_windows(tokens, seq_len, stride):
        assert len(inputs) == len(targets) == min(seq_len, n - 1) and 0 <= score_from < len(targets)
        np.testing.assert_array_equal(targets, inputs + 1)
        for j in range(score_from, len(targets)):
            assert j + 1 >= min(targets[j], seq_len - stride + 1)  # context: inputs[: j + 1]
            scored.append(targets[j])
    assert sorted(scored) == scored == list(range(1, n))


def test_eval_windows_full_context_example():
    windows = list(eval_windows(np.arange(10), seq_len=4, stride=2))
    assert [(list(t), s) for _, t, s in windows] == [
        ([1, 2, 3, 4], 0),
        ([3, 4, 5, 6], 2),
        ([5, 6, 7, 8], 2),
        ([6, 7, 8, 9], 3),  # the last window moves back to full length
    ]


def test_eval_windows_errors():
    with pytest.raises(QkvError, match="stride"):
        list(eval_windows(np.arange(10), seq_len=4, stride=5))
    with pytest.raises(QkvError, match="at least 2 tokens"):
        list(eval_windows(np.arange(1), seq_len=4, stride=2))
