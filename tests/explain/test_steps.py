"""qkv.explain.steps: the page's steps against what the engine records. Every panel names an array that a
traced run of some model produces (no panel can point at nothing), each step cites a note and a derivation
page that exists, ids are unique, the forward comes before the backward, cross-attention only where there is
an encoder's memory."""
import re
from pathlib import Path

import pytest

from qkv.explain.page import build_page, read_data
from qkv.explain.steps import steps_for
from qkv.explain.trace import trace
from tests.explain.test_trace import PROMPT, VARIANTS, make_run

DERIVATIONS = Path(__file__).resolve().parents[2] / "docs" / "derivations"
FAMILIES = ("decoder", "encoder", "encoder-decoder")
MORE = {"encoder-decoder-sandwich": dict(arch="encoder-decoder", norm_placement="sandwich"),
        "encoder-decoder-layernorm": dict(arch="encoder-decoder")}


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    """Every array name the variants' traces put on their pages, with {L} for each layer index (the inside steps'
    too: patching against a corrupted text for the rotary decoder)."""
    from qkv.explain.inside import look_inside
    from tests.explain.test_inside import corrupted_text

    names = set()
    for variant, model in {**VARIANTS, **MORE}.items():
        run = make_run(tmp_path_factory.mktemp(variant) / "run", **model)
        explanation = trace(run, PROMPT)
        look_inside(run, explanation, corrupted_text(run, PROMPT) if variant == "decoder-rope" else None)
        data = read_data(build_page([explanation]))
        names |= {re.sub(r"^\d+\.", "{L}.", key) for key in data["runs"][0]["arrays"]}
    return names


@pytest.mark.parametrize("family", FAMILIES)
def test_every_panel_shows_an_array_the_engine_records(family, recorded):
    missing = {p["array"] for s in steps_for(family) for p in s["panels"]} - recorded
    assert not missing, f"{family}: panels with no recorded array: {sorted(missing)}"


@pytest.mark.parametrize("family", FAMILIES)
def test_steps_are_unique_ordered_cited_and_documented(family):
    steps = steps_for(family)
    ids = [s["id"] for s in steps]
    assert len(ids) == len(set(ids))
    phases = [s["phase"] for s in steps]
    assert phases == sorted(phases, key=("forward", "backward", "inside").index)  # forward, backward, then inside
    for s in steps:
        assert re.search(r"note 00[023]", s["cite"]), s["id"]
        assert (DERIVATIONS / s["doc"]).is_file(), (s["id"], s["doc"])
        assert s["formula"] and s["title"]
        assert s["scope"] in ("model", "layer", "head")
        for p in s["panels"]:
            assert p["rows"] and (p["head"] is False or s["scope"] == "head" or "{L}" in p["array"])
    has_cross = any(s["part"] == "cross_attn" for s in steps)
    assert has_cross == (family == "encoder-decoder")
