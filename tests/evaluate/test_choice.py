"""Multiple choice by log-likelihood (qkv eval --task): EleutherAI's lm-evaluation-harness, scoring the same rows
through `qkv serve` with its local-completions model and a local task definition, is the oracle."""
import json
import random
import urllib.request

import numpy as np
import pytest

import qkv
from qkv.evaluate.choice import choice_scores, read_task
from tests.cli.test_main import cli
from tests.formats.gguf import write_llama
from tests.serve.live import Live

WORDS = "moon sea night sing silver wind golden crown star love heart rain light river".split()


def task_rows(n: int = 12, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        choices = [" " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 3))) for _ in range(4)]
        rows.append({"context": " ".join(rng.choice(WORDS) for _ in range(5)), "choices": choices,
                     "gold": rng.randrange(4)})
    return rows


TASK_YAML = """task: qkv_cloze
dataset_path: json
dataset_kwargs:
  data_files:
    test: {rows}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{context}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{gold}}}}"
target_delimiter: ""
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
  - metric: acc_norm
    aggregation: mean
    higher_is_better: true
"""


def test_scores_equal_lm_evaluation_harness_through_qkv_serve(tmp_path, capsys):
    lm_eval = pytest.importorskip("lm_eval", reason="lm-eval is a test dependency (pip install -e .[dev])")
    from lm_eval.tasks import TaskManager

    gguf_file = write_llama(tmp_path / "tiny.gguf")
    assert cli(capsys, "convert", str(gguf_file), "--to-hf", str(tmp_path / "hf"))[0] == 0  # its tokenizer
    rows = tmp_path / "task" / "rows.jsonl"
    rows.parent.mkdir()
    rows.write_text("".join(json.dumps(row) + "\n" for row in task_rows()))
    (rows.parent / "cloze.yaml").write_text(TASK_YAML.format(rows=rows))
    with Live(gguf_file) as live:
        name = json.load(urllib.request.urlopen(live.url + "/v1/models"))["data"][0]["id"]
        out = lm_eval.simple_evaluate(
            model="local-completions", tasks=["qkv_cloze"], log_samples=True,
            model_args={"base_url": live.url + "/v1/completions", "tokenizer": str(tmp_path / "hf"),
                        "tokenizer_backend": "huggingface", "model": name, "num_concurrent": 1, "max_retries": 1},
            task_manager=TaskManager(include_path=str(rows.parent)))
    theirs = out["results"]["qkv_cloze"]
    rc, stdout, err = cli(capsys, "eval", str(gguf_file), "--task", str(rows), "--json")
    assert rc == 0, err
    ours = json.loads(stdout)
    for key in ("acc", "acc_stderr", "acc_norm", "acc_norm_stderr"):
        assert ours[key] == pytest.approx(theirs[f"{key},none"], abs=1e-9), key
    assert 0 < ours["acc"] < 1 and ours["acc"] != ours["acc_norm"]  # a figure the oracle can disagree with
    samples = sorted(out["samples"]["qkv_cloze"], key=lambda s: s["doc_id"])
    lls = [np.array([r[0] for r in s["filtered_resps"]]) for s in samples]
    for mine, other in zip(choice_scores(qkv.load(gguf_file), read_task(str(rows))), lls):
        np.testing.assert_allclose(mine, other, rtol=1e-4, atol=1e-4)  # every choice's log-likelihood


@pytest.mark.parametrize("row, message", [
    ({"context": "a", "choices": [" b"], "gold": 0}, "two or more non-empty texts"),
    ({"context": "a", "choices": [" b", " c"], "gold": 2}, "gold=2 must be an index"),
    ({"choices": [" b", " c"], "gold": 0}, "expected {\"context\""),
])
def test_a_bad_task_row_is_named(tmp_path, capsys, row, message):
    gguf_file = write_llama(tmp_path / "tiny.gguf")
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps(row) + "\n")
    rc, _, err = cli(capsys, "eval", str(gguf_file), "--task", str(rows))
    assert rc == 2 and "rows.jsonl:1: " in err and message in err, err


def test_bits_per_byte_is_bits_per_char_for_ascii(tmp_path, capsys):
    gguf_file = write_llama(tmp_path / "tiny.gguf")
    text = tmp_path / "text.txt"
    text.write_text("the moon doth sing upon the silver sea\n" * 3)
    rc, stdout, err = cli(capsys, "eval", str(gguf_file), "--data", str(text), "--json")
    result = json.loads(stdout)
    assert rc == 0 and result["bits_per_byte"] == pytest.approx(result["bits_per_char"], rel=1e-12), err
    text.write_text("la lune chante: été, ô mer\n" * 3)
    result = json.loads(cli(capsys, "eval", str(gguf_file), "--data", str(text), "--json")[1])
    assert result["bits_per_byte"] == pytest.approx(result["bits_per_char"] * result["characters"] / result["bytes"])
