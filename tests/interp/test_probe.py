"""`qkv probe`: the logit lens and head scores of a text as JSON equal qkv.interp's numbers; bad options get one
line; on SmolLM2 (when its file is here) the lens names " Paris" at the last layer for "The capital of France
is"."""
import json

import pytest
import torch

from qkv.formats import load
from qkv.interp import logit_lens
from tests.cli.test_main import cli
from tests.formats.gguf import write_llama
from tests.formats.gguf.smollm2 import require_smollm2


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_llama(tmp_path_factory.mktemp("probe") / "m.gguf", seed=4)


def test_probe_json_is_the_logit_lens_and_the_head_scores(capsys, model):
    code, out, err = cli(capsys, "probe", model, "--text", "To be, or not to be", "--lens", "--heads", "--json")
    assert code == 0, err
    result = json.loads(out)
    run = load(model)
    ids = torch.tensor([run.tokenizer.encode("To be, or not to be")])
    rows = logit_lens(run.model, ids)
    assert [r["target_rank"] for r in result["lens"]["layers"]] == [r["target_rank"] for r in rows]
    assert result["lens"]["layers"][-1]["target_prob"] == pytest.approx(rows[-1]["target_prob"], abs=1e-6)
    heads = result["heads"]
    assert len(heads["previous_token"]) == 2 and len(heads["induction"][0]) == 4  # 2 layers x 4 heads
    code, out, _ = cli(capsys, "probe", model, "--text", "To be, or not to be", "--heads")
    assert code == 0 and "previous_token" in out and "induction" in out
    code, out, _ = cli(capsys, "probe", model, "--text", "To be, or not to be", "--attribution", "--json")
    found = json.loads(out)["attribution"]
    assert sum(t for _, t in found["components"]) + found["constant"] == pytest.approx(found["logit"], abs=1e-4)


@pytest.mark.parametrize("argv, message", [(["--text", "x"], "give --lens, --heads, --attribution, --experts or several"),
                                           (["--text", "x", "--heads", "--target", "x"], "--target applies to --lens"),
                                           (["--text", "", "--lens"], "--text is empty")])
def test_bad_probe_options_get_one_line(capsys, model, argv, message):
    code, _, err = cli(capsys, "probe", model, *argv)
    assert code == 2 and message in err and err.count("\n") == 1


def test_smollm2_lens_finds_paris_by_the_last_layer(capsys):
    path = require_smollm2()
    code, out, err = cli(capsys, "probe", path, "--text", "The capital of France is", "--lens", "--json")
    assert code == 0, err
    layers = json.loads(out)["lens"]["layers"]
    assert json.loads(out)["lens"]["target"] == " Paris"
    assert layers[-1]["target_rank"] == 0 and layers[0]["target_rank"] > 0


def test_a_steering_vector_written_by_probe_steers_generate(capsys, model, tmp_path):
    """qkv probe --minus writes mean resid_post(text) - mean resid_post(minus); qkv generate --steer adds it (x
    scale) at every step: the text equals generate under the same hook in Python, and differs from unsteered."""
    from safetensors.torch import load_file

    from qkv.generate.text import generate_text
    from qkv.interp import steer, steering_vector
    from qkv.nn.hookpoints import hooked

    out = tmp_path / "v.safetensors"
    code, text, err = cli(capsys, "probe", model, "--text", "To be, or not to be", "--minus", "the question",
                          "--layer", "1", "--out", out)
    assert code == 0 and "--steer" in text, err
    run = load(model)
    vector = load_file(out)["vector"]
    plus, minus = (torch.tensor([run.tokenizer.encode(t)]) for t in ("To be, or not to be", "the question"))
    assert torch.allclose(vector, steering_vector(run.model, plus, minus, 1), atol=1e-6)
    argv = ["generate", model, "--prompt", "Whether", "--strategy", "greedy", "--max-new-tokens", "12"]
    code, steered, _ = cli(capsys, *argv, "--steer", f"{out}@1:8")
    code2, plain, _ = cli(capsys, *argv)
    assert code == code2 == 0 and steered != plain
    with hooked(run.model, [("blocks.1.resid_post", steer(vector, 8.0))]):
        expected = generate_text(run, "Whether", max_new_tokens=12, strategy="greedy", temperature=1.0, top_k=50,
                                 top_p=1.0, num_beams=1, seed=0)
    assert steered.strip() == expected.strip()
    code, _, err = cli(capsys, "probe", model, "--text", "a", "--minus", "b", "--layer", "1", "--out", out)
    assert code == 2 and "exists" in err  # nothing overwritten


@pytest.mark.parametrize("spec, message", [("{f}@9:1", "block 9 is not in this model"), ("{f}@x:1", "FILE@LAYER:SCALE"),
                                           ("{f}.missing@1:1", "--steer"), ("{f}@1:nan", "finite"), ("{bad}@1:1", "needs one tensor 'vector'")])
def test_bad_steering_gets_one_line(capsys, model, tmp_path, spec, message):
    from safetensors.torch import save_file

    good, bad = tmp_path / "v.safetensors", tmp_path / "bad.safetensors"
    save_file({"vector": torch.zeros(64)}, str(good))
    save_file({"vector": torch.zeros(3)}, str(bad))
    code, _, err = cli(capsys, "generate", model, "--prompt", "x", "--max-new-tokens", "2",
                       "--steer", spec.format(f=good, bad=bad))
    assert code == 2 and message in err and err.count("\n") == 1, err


def test_patching_prompts_of_different_lengths_get_one_line(capsys, model):
    code, _, err = cli(capsys, "probe", model, "--text", "To be, or not to be", "--corrupt", "To be")
    assert code == 2 and "one length" in err and err.count("\n") == 1


def test_smollm2_patching_moves_france_to_the_last_position_in_the_upper_middle(capsys):
    path = require_smollm2()
    code, out, err = cli(capsys, "probe", path, "--text", "The capital of France is", "--corrupt",
                         "The capital of Italy is", "--json")
    assert code == 0, err
    found = json.loads(out)["patching"]
    assert (found["answer"], found["wrong"]) == (" Paris", " Rome")
    rows = found["recovered"]
    assert rows[-1][-1] == pytest.approx(1.0, abs=1e-4) and rows[0][3] == pytest.approx(1.0, abs=1e-4)
    moved = next(layer for layer, row in enumerate(rows) if row[-1] > 0.5)  # where the last position takes it over
    assert 10 <= moved < 30


def test_per_head_needs_corrupt(capsys, model):
    code, _, err = cli(capsys, "probe", model, "--text", "To be", "--lens", "--per-head")
    assert code == 2 and "--per-head applies to --corrupt" in err
