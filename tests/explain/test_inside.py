"""The page's "inside" steps (qkv.explain.inside): the logit lens, head scores, direct logit attribution and
activation patching it embeds are qkv.interp's on the run's model (themselves checked against transformers and
nnsight in tests/interp/), for the explained position and target; a Post-LN decoder has no attribution, and an
encoder no inside steps."""
import numpy as np
import pytest
import torch

from qkv.explain import explain_page
from qkv.explain.page import read_data
from qkv.explain.steps import steps_for
from qkv.formats import load
from qkv.interp import (direct_logit_attribution, head_patching_map, head_scores, induction_scores, logit_lens,
                        patching_map)
from tests.explain.test_cli import write_run
from tests.explain.test_trace import PROMPT, VARIANTS

TOL = 1e-5  # the page's float32 with 17 mantissa bits: 3.8e-6 relative


def close(page, want):
    want = np.asarray(want, dtype=np.float64)
    assert page.shape == want.shape
    assert np.abs(page - want).max() <= TOL * max(1.0, np.abs(want).max())


def corrupted_text(run, text: str) -> str:
    """A text of as many tokens whose top next token differs: the clean text with one word swapped."""
    ids = run.tokenizer.encode(text)
    answer = int(run.model(torch.tensor([ids]))[0, -1].argmax())
    for word in ("cat", "dog", "hat", "rat", "sun", "bed", "day"):
        other = text.replace("mat", word)
        other_ids = run.tokenizer.encode(other)
        if len(other_ids) == len(ids) and int(run.model(torch.tensor([other_ids]))[0, -1].argmax()) != answer:
            return other
    raise AssertionError("no corrupted text changes the answer")


@pytest.fixture(scope="module")
def decoder_page(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("inside")
    path = write_run(tmp / "run", **VARIANTS["decoder-rope"])
    run = load(path)
    corrupt = corrupted_text(run, PROMPT)
    explain_page([path], PROMPT, out=tmp / "page.html", corrupt=corrupt)
    data = read_data((tmp / "page.html").read_text(encoding="utf-8"))["runs"][0]
    return run, corrupt, data["meta"], data["arrays"]


def test_the_page_holds_qkv_interps_numbers(decoder_page):
    run, corrupt, meta, arrays = decoder_page
    ids, position, target = torch.tensor([meta["ids"]]), meta["position"], meta["target"]["id"]
    lens = logit_lens(run.model, ids, position=position, target=target)
    assert [row["rank"] for row in meta["lens"]] == [row["target_rank"] for row in lens]
    assert [row["prob"] for row in meta["lens"]] == pytest.approx([row["target_prob"] for row in lens], abs=1e-9)
    assert meta["lens"][-1]["rank"] == 0  # the explained target is the model's own top token
    assert meta["lens"][1]["top"][0][0] == run.tokenizer.decode([lens[1]["top"][0][0]])
    scores = head_scores(run.model, ids)
    close(arrays["inside.heads.previous"], scores["previous_token"])
    close(arrays["inside.heads.first"], scores["first_token"])
    close(arrays["inside.heads.induction"], induction_scores(run.model, run.config.model.vocab_size))
    found = direct_logit_attribution(run.model, ids, position=position, target=target)
    terms = dict(found["components"])
    close(arrays["inside.dla.heads"], [[terms[f"blocks.{i}.attn.head{h}"] for h in range(4)] for i in range(2)])
    close(arrays["inside.dla.ffn"], [terms[f"blocks.{i}.ffn"] for i in range(2)])
    parts = arrays["inside.dla.heads"].sum() + arrays["inside.dla.ffn"].sum() + meta["dla"]["embedding"]
    assert parts + meta["dla"]["constant"] == pytest.approx(meta["dla"]["logit"], abs=1e-4)  # they add up
    other = torch.tensor([run.tokenizer.encode(corrupt)])
    wrong = int(run.model(other)[0, -1].argmax())
    assert meta["patching"]["answer"] == run.tokenizer.decode([target])
    assert meta["patching"]["wrong"] == run.tokenizer.decode([wrong])
    close(arrays["inside.patching"], patching_map(run.model, ids, other, answer=target, wrong=wrong)["recovered"])
    close(arrays["inside.patching.heads"], head_patching_map(run.model, ids, other, answer=target, wrong=wrong))
    assert arrays["inside.patching"][-1, -1] == pytest.approx(1.0, abs=1e-5)


def test_post_ln_has_no_attribution_and_no_corrupt_no_patching(tmp_path):
    path = write_run(tmp_path / "post", **VARIANTS["decoder-alibi-post-rms-glu-gqa"])
    explain_page([path], PROMPT, out=tmp_path / "page.html")
    data = read_data((tmp_path / "page.html").read_text(encoding="utf-8"))["runs"][0]
    names = set(data["arrays"])
    assert {"inside.heads.previous", "inside.heads.induction"} <= names and len(data["meta"]["lens"]) == 3
    assert not any(name.startswith(("inside.dla", "inside.patching")) for name in names)
    assert "dla" not in data["meta"] and "patching" not in data["meta"]


def test_only_decoders_have_inside_steps():
    assert [s["id"] for s in steps_for("decoder") if s["phase"] == "inside"] == [
        "inside.lens", "inside.heads", "inside.dla", "inside.patching"]
    assert not any(s["phase"] == "inside" for s in steps_for("encoder") + steps_for("encoder-decoder"))
