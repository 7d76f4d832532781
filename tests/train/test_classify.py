"""The classify task end to end on a tiny labelled fixture (qkv.data.genres' split replaced by made-up works
whose label shows in their words): training beats the majority class, `qkv eval` and `qkv classify` report
the same model, fine-tuning starts from an MLM run's encoder, and bad input exits 2 with one line."""
import contextlib
import io
import json
import random

import numpy as np
import pytest
import torch

from qkv.cli import main
from qkv.config import ModelConfig
from qkv.data import genres
from qkv.errors import QkvError
from qkv.models import build_model
from qkv.evaluate import classify
from qkv.files import MODEL_FILE, read_tensors
from qkv.train.finetune import load_backbone
from tests.cli.test_main import assert_one_error_line, cli
from tests.train import WORDS, setup_env, trained_run

CUES = {0: "jest wedding dance laugh fool merry masque feast".split(),
        1: "king crown england france battle throne duke herald".split(),
        2: "blood grave poison dagger ghost death murder tomb".split()}
TINY_CLASSIFIER = ["--task", "classify", "--set", "model.d_model=32", "--set", "model.n_layers=1", "--set",
                   "model.d_ff=64", "--set", "model.max_seq_len=32", "--set", "train.seq_len=32", "--set",
                   "train.lr=1e-2", "--set", "train.warmup_steps=5", "--set", "train.eval_batches=2", "--set",
                   "data.vocab_size=300", "--set", "train.threads=1", "--quiet"]


def fixture_work(label: int, index: int, lines: int = 60) -> genres.Work:
    """Lines of common words where about a third of the words are the label's cue words."""
    rng = random.Random(10 * label + index)
    text = "\n".join(" ".join(rng.choice(CUES[label]) if rng.random() < 0.3 else rng.choice(WORDS)
                              for _ in range(6)) for _ in range(lines))
    return genres.Work(f"work_{label}_{index}", label, text)


@pytest.fixture(autouse=True, scope="module")
def fixture_split(tmp_path_factory):
    with pytest.MonkeyPatch.context() as patch:
        setup_env(patch, tmp_path_factory)
        works = [fixture_work(label, i) for label in range(3) for i in range(4)]
        patch.setattr(genres, "bundled_split", lambda: genres.split_works(works, 1, 1))  # 2 / 1 / 1 per label
        yield


@pytest.fixture(scope="module")
def classifier(tmp_path_factory):
    """One tiny classifier trained through the CLI for the module (40 steps); tests must not modify it."""
    out = tmp_path_factory.mktemp("classify") / "run"
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        rc = main(["train", *TINY_CLASSIFIER, "--max-steps", "40", "--out", str(out), "--json"])
    assert rc == 0, stderr.getvalue()
    return out, json.loads(stdout.getvalue())


def test_training_beats_the_majority_class_and_eval_agrees(capsys, classifier):
    run, summary = classifier
    assert summary["majority_test_accuracy"] == pytest.approx(1 / 3, abs=0.05)  # one test work per label
    assert summary["test_accuracy"] > summary["majority_test_accuracy"] + 0.3, summary
    assert summary["bow_test_accuracy"] > 0.9  # the cue words are a bag-of-words signal
    assert json.loads((run / "config.json").read_text())["model"]["labels"] == list(genres.LABELS)
    rc, out, err = cli(capsys, "eval", run, "--json")
    assert rc == 0, err
    result = json.loads(out)
    assert round(result["test"]["accuracy"], 4) == summary["test_accuracy"]  # the same model, the same passages
    confusion = np.array(result["test"]["confusion"])
    assert confusion.sum() == result["test"]["passages"]
    assert np.trace(confusion) / confusion.sum() == pytest.approx(result["test"]["accuracy"])
    rc, out, _ = cli(capsys, "eval", run)
    assert rc == 0 and "accuracy" in out and "baseline" in out


def test_classify_prints_each_label_with_its_probability(capsys, classifier):
    run, _ = classifier
    rc, out, err = cli(capsys, "classify", run, "--text", "blood grave poison dagger ghost death murder tomb " * 3,
                       "--json")
    assert rc == 0, err
    probs = json.loads(out)
    assert set(probs) == set(genres.LABELS) and sum(probs.values()) == pytest.approx(1.0, abs=1e-6)
    assert max(probs, key=probs.get) == "tragedy"
    rc, out, _ = cli(capsys, "classify", run, "--text", "king crown england")
    lines = out.splitlines()
    assert rc == 0 and len(lines) == 3 and {line.split()[0] for line in lines} == set(genres.LABELS)
    assert_one_error_line(*cli(capsys, "classify", run, "--text", "  "), "--text is empty")


def test_long_text_is_the_mean_over_its_windows(classifier):
    from qkv.formats import load

    run = load(classifier[0])
    text = " ".join(fixture_work(1, 9).text.split()[:120])
    ids = np.asarray(run.tokenizer.encode(text))
    T = run.config.train.seq_len
    assert len(ids) > 2 * T
    starts = list(range(0, len(ids) - T + 1, T)) + [len(ids) - T]
    with torch.no_grad():
        logits = run.model(torch.as_tensor(np.stack([ids[s:s + T] for s in dict.fromkeys(starts)])))
    expected = torch.softmax(logits.double(), -1).mean(0).numpy()
    np.testing.assert_allclose(list(classify.classify_text(run, text).values()), expected, atol=1e-9)


def test_fine_tuning_starts_from_an_mlm_runs_encoder(capsys, monkeypatch, tmp_path, tmp_path_factory):
    mlm, text = tmp_path / "mlm", setup_env(monkeypatch, tmp_path_factory)  # the verse file
    rc, _, err = cli(capsys, "train", "--preset", "bert-shakespeare", "--data", text, "--out", mlm,
                     "--max-steps", "2", *TINY_CLASSIFIER[2:], "--no-sample")
    assert rc == 0, err
    rc, out, err = cli(capsys, "train", *TINY_CLASSIFIER, "--init", mlm, "--max-steps", "1", "--out",
                       tmp_path / "cls", "--json", "--set", "train.lr=1e-9", "--set", "train.warmup_steps=0")
    assert rc == 0 and "the head starts fresh" in err, err
    before, after = read_tensors(mlm / MODEL_FILE), read_tensors(tmp_path / "cls" / MODEL_FILE)
    encoder = [name for name in after if name.startswith("encoder.")]
    assert encoder and all(torch.allclose(after[n], before[n], atol=1e-6) for n in encoder)  # lr 1e-9: one tiny step
    assert not any(name.startswith("head.pooler") for name in before)
    cfg = json.loads((tmp_path / "cls" / "config.json").read_text())
    assert cfg["model"]["vocab_size"] == json.loads((mlm / "config.json").read_text())["model"]["vocab_size"]
    assert cfg["train"]["init"] == str(mlm.resolve())


def test_load_backbone_copies_all_but_the_head_and_checks_shapes():
    base = ModelConfig(arch="encoder", vocab_size=40, d_model=16, n_heads=2, n_layers=1, d_ff=32, max_seq_len=16)
    mlm = build_model(base.__class__(**{**base.__dict__, "head": "mlm"}))
    cls = build_model(base.__class__(**{**base.__dict__, "head": "classifier", "n_classes": 3}))
    copied, fresh = load_backbone(cls, mlm, "mlm")
    assert copied == sum(1 for n, _ in cls.named_parameters() if n.startswith("encoder."))
    assert fresh == sum(1 for n, _ in cls.named_parameters() if n.startswith("head."))
    mlm_params = dict(mlm.named_parameters())
    assert all(torch.equal(p, mlm_params[n]) for n, p in cls.named_parameters() if n.startswith("encoder."))
    wider = build_model(base.__class__(**{**base.__dict__, "head": "mlm", "d_ff": 48}))
    with pytest.raises(QkvError, match="has shape"):
        load_backbone(cls, wider, "wider")
    with pytest.raises(QkvError, match="no tensor"):
        load_backbone(cls, build_model(ModelConfig(vocab_size=40, d_model=16, n_heads=2, n_layers=1, d_ff=32)), "lm")


def test_bad_inputs_exit_2_with_one_line(capsys, tmp_path, tmp_path_factory):
    lm_run = trained_run(tmp_path_factory)[0]
    assert_one_error_line(*cli(capsys, "classify", tmp_path / "missing", "--text", "x"), "no such run directory")
    assert_one_error_line(*cli(capsys, "classify", lm_run, "--text", "x"), "supports classify", "'lm'")
    assert_one_error_line(*cli(capsys, "train", *TINY_CLASSIFIER, "--init", lm_run, "--out", tmp_path / "a"),
                          "model.arch='decoder'")
    assert_one_error_line(*cli(capsys, "train", "--task", "nope", "--out", tmp_path / "b"), "unknown task", "classify")
    assert_one_error_line(*cli(capsys, "train", *TINY_CLASSIFIER, "--data", "x.txt", "--out", tmp_path / "c"),
                          "data.paths")
    assert not any((tmp_path / name).exists() for name in "abc")
