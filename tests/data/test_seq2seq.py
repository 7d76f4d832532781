"""Seq2seq pairs from a token stream (SPEC B10): lines between break tokens, the next-line and reverse tasks,
teacher-forcing collation (BOS + target in, target + EOS out, -100 under padding), resumable sampling."""
import json

import numpy as np
import pytest

from qkv.data.seq2seq import IGNORE, Seq2SeqBatches, SEQ2SEQ_TASKS, collate, line_spans
from qkv.data.tokenizer import Tokenizer
from qkv.errors import QkvError

NL, EOS, PAD = 9, 0, 99


def test_lines_are_the_non_empty_runs_between_breaks():
    tokens = np.array([EOS, 1, 2, NL, 3, NL, NL, 4, 5, 6, EOS, 7])
    spans = line_spans(tokens, [NL, EOS])
    assert [tokens[a:b].tolist() for a, b in spans] == [[1, 2], [3], [4, 5, 6], [7]]


def test_tasks():
    tokens = np.array([1, 2, NL, 3, 4, 5])
    spans = line_spans(tokens, [NL])
    src, tgt = SEQ2SEQ_TASKS.get("next-line")(tokens, spans, 0)
    assert (src.tolist(), tgt.tolist()) == ([1, 2], [3, 4, 5])
    src, tgt = SEQ2SEQ_TASKS.get("reverse")(tokens, spans, 1)
    assert (src.tolist(), tgt.tolist()) == ([3, 4, 5], [5, 4, 3])


def test_collate_shifts_targets_and_masks_padding():
    pairs = [(np.array([1, 2, 3]), np.array([4, 5])), (np.array([6]), np.array([7, 8, 9, 10]))]
    src, src_mask, tgt_in, tgt_mask, labels = collate(pairs, seq_len=4, bos_id=EOS, eos_id=EOS, pad_id=PAD)
    assert src.tolist() == [[1, 2, 3], [6, PAD, PAD]] and src_mask.tolist() == [[1, 1, 1], [1, 0, 0]]
    # targets keep seq_len - 1 = 3 tokens, so BOS + target fits in seq_len
    assert tgt_in.tolist() == [[EOS, 4, 5, PAD], [EOS, 7, 8, 9]]
    assert labels.tolist() == [[4, 5, EOS, IGNORE], [7, 8, 9, EOS]]
    assert tgt_mask.tolist() == [[1, 1, 1, 0], [1, 1, 1, 1]]


def batches(tokens=None, **kw) -> Seq2SeqBatches:
    tokens = np.tile(np.array([1, 2, NL, 3, 4, 5, NL, 6, NL]), 20) if tokens is None else tokens
    args = dict(seq_len=8, batch_size=4, seed=1, task="next-line", break_ids=[NL, EOS], bos_id=EOS, eos_id=EOS,
                pad_id=PAD)
    return Seq2SeqBatches(tokens, **{**args, **kw})


def test_every_pair_is_two_consecutive_lines():
    lines = {(1, 2): (3, 4, 5), (3, 4, 5): (6,), (6,): (1, 2)}
    for _ in range(10):
        src, src_mask, tgt_in, tgt_mask, labels = batches().next()
        for row in range(4):
            source = tuple(src[row][src_mask[row] == 1])
            target = tuple(labels[row][labels[row] != IGNORE][:-1])
            assert lines[source] == target
            assert tgt_in[row, 0] == EOS and tuple(tgt_in[row, 1:][tgt_mask[row, 1:] == 1]) == target


def test_state_is_json_and_resumes_exactly():
    a = batches()
    a.next()
    state = json.loads(json.dumps(a.state()))
    expected = [a.next() for _ in range(3)]
    b = batches()
    b.load_state(state)
    for want in expected:
        assert all(np.array_equal(x, y) for x, y in zip(want, b.next()))
    with pytest.raises(QkvError, match="data state is for task"):
        batches(task="reverse").load_state(state)


def test_ranks_split_one_global_batch():
    whole = batches().next()
    halves = [batches(rank=r, world=2).next() for r in range(2)]
    assert np.array_equal(halves[0][4], whole[4][0::2][:, :halves[0][4].shape[1]])


def test_too_few_lines_is_an_error():
    with pytest.raises(QkvError, match="at least 2 non-empty lines"):
        batches(tokens=np.array([1, 2, 3]))


def test_lines_of_real_text_through_the_tokenizer(monkeypatch, tmp_path):
    """Newlines live in whitespace-only byte-level tokens: the token stream's lines decode to the text's lines."""
    monkeypatch.setenv("QKV_CACHE", str(tmp_path))
    text = "the moon doth sing\nupon the silver sea\n\nand all the river runs\n" * 20
    tokenizer = Tokenizer.train([text], 300)
    breaks = [i for i, data in enumerate(tokenizer.token_bytes) if b"\n" in data] + [tokenizer.eos_id]
    tokens = np.array([tokenizer.eos_id] + tokenizer.encode(text))
    lines = [tokenizer.decode(tokens[a:b]) for a, b in line_spans(tokens, breaks)]
    assert lines == [line for line in text.split("\n") if line]


def test_the_task_is_validated_with_the_data_config():
    from qkv.train.checks import check_run
    from qkv.config import DataConfig, RunConfig

    with pytest.raises(QkvError, match="data.seq2seq_task='copy' is not allowed; choose from: folio, next-line, "
                                       "reverse"):
        check_run(RunConfig(data=DataConfig(seq2seq_task="copy")))


TAB = 8


def test_folio_pairs_are_the_two_sides_of_a_separator():
    """Lines "source<TAB>target": the separator ends the source; a line without one makes no pair."""
    tokens = np.array([EOS, 1, 2, TAB, 3, NL, 4, NL, 5, TAB, 6, 7, NL, TAB, 1, NL])
    b = batches(tokens, task="folio", separator_ids=[TAB])
    assert [tokens[a:z].tolist() for a, z in b.spans] == [[1, 2], [3], [4], [5], [6, 7], [1]]
    assert b.starts.tolist() == [0, 3]  # "4" has no target and "<TAB>1" no source
    assert [(s.tolist(), t.tolist()) for s, t in b.pairs(10)] == [([1, 2], [3]), ([5], [6, 7])]
    for _ in range(5):
        src, src_mask, _, _, labels = b.next()
        for row in range(4):
            pair = (tuple(src[row][src_mask[row] == 1]), tuple(labels[row][labels[row] != IGNORE][:-1]))
            assert pair in {((1, 2), (3,)), ((5,), (6, 7))}
    with pytest.raises(QkvError, match="finds no pair in the text"):
        batches(np.array([EOS, 1, 2, NL, 3, NL]), task="folio", separator_ids=[TAB])


def test_pairs_for_scoring_are_spread_evenly_and_in_order():
    b = batches()  # next-line over 60 lines: 59 pairs
    assert len(b.pairs(1000)) == len(b.starts) == 59
    firsts = [tuple(s.tolist()) for s, _ in b.pairs(3)]
    assert firsts == [tuple(b.tokens[slice(*b.spans[i])].tolist()) for i in (0, 29, 58)]


def test_folio_lines_through_the_tokenizer():
    """The tab of "modern<TAB>folio" is a token of its own after byte-level BPE: the pairs decode to the sides."""
    pairs = [("Upon the heath.", "Vpon the Heath"),
             ("When shall we three meet again?", "When shall we three meet againe?"),
             ("Hover through the fog and filthy air.", "Houer through the fogge and filthie ayre.")] * 10
    text = "\n".join(f"{a}\t{b}" for a, b in pairs)
    tokenizer = Tokenizer.train([text], 300)
    breaks = [i for i, data in enumerate(tokenizer.token_bytes) if b"\n" in data] + [tokenizer.eos_id]
    separators = [i for i, data in enumerate(tokenizer.token_bytes) if b"\t" in data]
    tokens = np.array([tokenizer.eos_id] + tokenizer.encode(text))
    b = batches(tokens, task="folio", break_ids=breaks, separator_ids=separators)
    assert [(tokenizer.decode(s.tolist()), tokenizer.decode(t.tolist())) for s, t in b.pairs(100)] == pairs
