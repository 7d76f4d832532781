"""`qkv eval`'s scoring of a run (qkv.evaluate.scoring): a text that fits the context is scored by one forward
of [eos] + its tokens, every token after the start counted, bits per character = nats / (ln 2 x characters);
a longer text's sliding windows score each token once, whatever the stride; bad input is one error."""
import math

import pytest
import torch
import torch.nn.functional as F

from qkv.errors import QkvError
from qkv.formats import load
from qkv.evaluate.scoring import score_run, text_tokens
from tests.train import setup_env, trained_run


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    monkeypatch = pytest.MonkeyPatch()
    setup_env(monkeypatch, tmp_path_factory)  # the verse file and the token cache the shared run needs
    path, _ = trained_run(tmp_path_factory)
    yield load(str(path))
    monkeypatch.undo()


def test_a_short_text_is_one_forward(run, tmp_path):
    text = "Where golden crowns lie sleeping under stars."
    (tmp_path / "t.txt").write_text(text)
    tokens = text_tokens(run, text)
    assert tokens[0] == run.tokenizer.eos_id and len(tokens) <= run.config.model.max_seq_len
    with torch.no_grad():
        logits = run.model.eval()(torch.as_tensor(tokens[None, :-1])).float()[0]
    nats = F.cross_entropy(logits, torch.as_tensor(tokens[1:]), reduction="sum").item()
    got = score_run(run, [str(tmp_path / "t.txt")])
    assert got["tokens"] == len(tokens) - 1 and got["characters"] == len(text)
    assert got["bits_per_char"] == pytest.approx(nats / (math.log(2) * len(text)), rel=1e-6)


def test_a_long_text_scores_every_token_once(run, tmp_path):
    text = " ".join(["the river runs to meet her and all the moon doth sing"] * 40)
    (tmp_path / "t.txt").write_text(text)
    got = score_run(run, [str(tmp_path / "t.txt")])
    assert got["tokens"] == len(text_tokens(run, text)) - 1  # windows overlap, scored positions do not
    disjoint = score_run(run, [str(tmp_path / "t.txt")], stride=run.config.model.max_seq_len)
    assert disjoint["tokens"] == got["tokens"]  # any stride: each token once


def test_bad_input_is_one_error(run, tmp_path):
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(QkvError, match="empty"):
        score_run(run, [str(tmp_path / "empty.txt")])
    (tmp_path / "t.txt").write_text("a b c")
    with pytest.raises(QkvError, match="exceeds the model's context"):
        score_run(run, [str(tmp_path / "t.txt")], stride=run.config.model.max_seq_len + 1)
