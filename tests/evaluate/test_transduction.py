"""A seq2seq run's held-out figures (qkv.evaluate.transduction): on a tiny learnable fixture of "modern<TAB>folio"
lines, training through `qkv train --preset folio` moves chrF and exact-line accuracy past the copy-the-input
baseline; `qkv eval` reports the same figures and `qkv generate` writes the Folio spelling by beam search."""
import json
import random

import pytest

from qkv.cli import main
from qkv.data.corpus import read_documents, split_documents
from qkv.evaluate.chrf import chrf, exact
from tests.train import setup_env

# a spelling for each word, as the Folio prints it; three words are spelled alike
FOLIO = {"upon": "vpon", "again": "againe", "sun": "sunne", "have": "haue", "love": "loue", "heaven": "heauen",
         "fear": "feare", "justice": "iustice", "the": "the", "and": "and", "my": "my"}


def held_out_lines(path) -> list[str]:
    return split_documents(read_documents([str(path)]), 0.1)[1][0].text.strip().split("\n")


def pairs(count: int, seed: int = 0) -> list[tuple[str, str]]:
    rng = random.Random(seed)
    rows = []
    for _ in range(count):
        words = [rng.choice(sorted(FOLIO)) for _ in range(rng.randint(2, 4))]
        rows.append((" ".join(words), " ".join(FOLIO[w] for w in words)))
    return rows


@pytest.fixture
def pair_file(monkeypatch, tmp_path_factory, tmp_path):
    setup_env(monkeypatch, tmp_path_factory)
    path = tmp_path / "pairs.tsv"
    path.write_text("\n".join(f"{a}\t{b}" for a, b in pairs(400)) + "\n", encoding="utf-8")
    return path


SIZES = {"model.d_model": 64, "model.n_heads": 4, "model.n_layers": 1, "model.d_ff": 128, "model.max_seq_len": 24,
         "model.dropout": 0.0, "train.batch_size": 64, "train.seq_len": 16, "train.lr": 0.3, "train.warmup_steps": 20,
         "train.eval_batches": 1, "train.threads": 1, "train.device": "cpu", "data.vocab_size": 300}


def test_training_beats_the_copy_baseline_and_eval_and_generate_agree(pair_file, tmp_path, capsys):
    run = tmp_path / "run"
    settings = [arg for key, value in SIZES.items() for arg in ("--set", f"{key}={value}")]
    assert main(["train", "--preset", "folio", "--data", str(pair_file), "--out", str(run), "--max-steps", "100",
                 "--quiet", "--json", *settings]) == 0, capsys.readouterr().err
    summary = json.loads(capsys.readouterr().out)
    # every pair of the held-out tail (data.val_fraction = 10% of the file) is scored: the copy baseline on them
    sources, targets = zip(*(line.split("\t") for line in held_out_lines(pair_file)))
    assert summary["val_pairs"] == len(sources) == 40
    assert summary["copy_chrf"] == pytest.approx(chrf(sources, targets), abs=0.01)
    assert summary["copy_exact_accuracy"] == pytest.approx(exact(sources, targets), abs=1e-4)
    assert summary["val_chrf"] > summary["copy_chrf"] + 5, summary
    assert summary["val_exact_accuracy"] > summary["copy_exact_accuracy"] + 0.1, summary

    assert main(["eval", str(run), "--json"]) == 0
    scores = json.loads(capsys.readouterr().out)
    assert (scores["chrf"], scores["exact_accuracy"]) == (summary["val_chrf"], summary["val_exact_accuracy"])
    assert main(["eval", str(run), "--stride", "4"]) == 2
    assert "--stride applies to language models" in capsys.readouterr().err

    # `qkv generate` translates by beam search by default, as the batched scoring did
    for example in (scores["example 1"], scores["example 2"]):
        assert main(["generate", str(run), "--prompt", example["source"], "--max-new-tokens", "16"]) == 0
        assert capsys.readouterr().out.strip() == example["output"]
