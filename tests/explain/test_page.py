"""The page in headless Chromium (Playwright, the system's chromium; no network): it loads with no console
error, the step list and the keys navigate, the layer and head pickers re-slice, hovering a heat-map cell
shows that cell's exact value, and the sampling controls recompute the distribution as note 003's
strategies do (checked against qkv.generate's own processors on the page's logits)."""
import numpy as np
import pytest
import torch

from qkv.explain.page import build_page, read_data
from qkv.explain.trace import trace
from qkv.generate.sampling import SamplingParams, SamplingState, process
from tests.browser import FLAGS
from tests.explain.test_trace import PROMPT, VARIANTS, make_run

sync_api = pytest.importorskip("playwright.sync_api")  # in the dev extra


@pytest.fixture(scope="module")
def browser(chromium):
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=FLAGS)
        yield browser
        browser.close()


@pytest.fixture(scope="module")
def page_file(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("explain")
    runs = [make_run(tmp / "rope", **VARIANTS["decoder-rope"]), make_run(tmp / "alibi", **VARIANTS["decoder-alibi-post-rms-glu-gqa"])]
    single, both = tmp / "single.html", tmp / "both.html"
    single.write_text(build_page([trace(runs[0], PROMPT)]), encoding="utf-8")
    both.write_text(build_page([trace(run, PROMPT) for run in runs]), encoding="utf-8")
    return single, both


def open_page(browser, path, fragment=""):
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    errors = []
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.route("**/*", lambda route: route.abort() if not route.request.url.startswith("file:") else route.continue_())
    page.goto(path.as_uri() + fragment)
    page.wait_for_function("document.getElementById('status').dataset.ready")
    return page, errors


def status(page) -> str:
    """The page's state once its latest render has finished (every panel drawn)."""
    page.wait_for_function("document.getElementById('status').dataset.ready !== ''")
    return page.inner_text("#status")


def test_loads_without_errors_and_navigates(browser, page_file):
    page, errors = open_page(browser, page_file[0])
    assert status(page) == "step=tokens layer=0 head=0"
    page.click("nav a[data-step='attn.scores']")
    assert status(page).startswith("step=attn.scores")
    page.keyboard.press("ArrowRight")
    assert status(page).startswith("step=attn.softmax")
    page.keyboard.press("ArrowLeft")
    page.select_option("#layer", "1")
    page.select_option("#head", "3")
    assert status(page) == "step=attn.scores layer=1 head=3"
    for step in page.eval_on_selector_all("nav a", "links => links.map(a => a.dataset.step)"):  # every step renders
        page.click(f"nav a[data-step='{step}']")
        assert status(page).startswith(f"step={step} ")
    assert errors == []
    page.close()


def test_hover_shows_the_exact_value_of_the_cell(browser, page_file):
    data = read_data(page_file[0].read_text(encoding="utf-8"))
    weights = data["runs"][0]["arrays"]["1.attn.weights"]  # (H, T, S)
    page, errors = open_page(browser, page_file[0], "#step=attn.softmax&layer=1&head=2")
    canvas = page.query_selector_all("canvas")[1]  # M, then A
    box = canvas.bounding_box()
    T = weights.shape[-1]
    row, col = T - 1, 3
    page.mouse.move(box["x"] + (col + 0.5) * box["width"] / T, box["y"] + (row + 0.5) * box["height"] / T)
    tip = page.inner_text("#tip")
    assert tip.startswith(f"row {row} ") and f"col {col} " in tip
    assert float(tip.split("\n")[1]) == pytest.approx(float(weights[2, row, col]), rel=1e-7)
    assert errors == []
    page.close()


def distribution(logits, temperature, top_k, top_p):
    """qkv.generate's own processors (temperature, top_k, top_p) on the page's logits: (kept, top probability)."""
    params = SamplingParams(temperature=temperature, top_k=top_k or len(logits), top_p=top_p).validate()
    state = SamplingState(params, torch.zeros(1, 1, dtype=torch.long))
    out = process(torch.tensor(logits)[None], state, ("temperature", "top_k", "top_p"))[0]
    return int(torch.isfinite(out).sum()), float(out.softmax(-1).max())


def test_sampling_controls_recompute_the_distribution(browser, page_file):
    data = read_data(page_file[0].read_text(encoding="utf-8"))
    logits = data["runs"][0]["arrays"]["output.logits"].astype(np.float64)
    page, errors = open_page(browser, page_file[0], "#step=output")
    summaries = {}
    for temperature, top_k, top_p in ((1, 0, 1), (0.5, 0, 1), (1, 3, 1), (1, 0, 0.5), (2, 5, 0.9), (0.7, 40, 0.3)):
        page.fill("input.topk", str(top_k))
        page.eval_on_selector("input.temperature", f"(el) => {{ el.value = {temperature}; el.dispatchEvent(new Event('input')); }}")
        page.eval_on_selector("input.topp", f"(el) => {{ el.value = {top_p}; el.dispatchEvent(new Event('input')); }}")
        summary = page.inner_text(".dist-summary")
        kept, top = distribution(logits, temperature, top_k, top_p)
        assert summary.startswith(f"{kept} tokens kept"), (temperature, top_k, top_p, summary)
        assert float(summary.rsplit("p=", 1)[1]) == pytest.approx(top, abs=2e-6)
        summaries[(temperature, top_k, top_p)] = summary
    assert len(set(summaries.values())) == len(summaries)  # every setting changed what is shown
    assert errors == []
    page.close()


def test_compare_shows_both_runs_side_by_side(browser, page_file):
    page, errors = open_page(browser, page_file[1], "#step=b.gradnorm")
    assert page.eval_on_selector_all(".run h4", "hs => hs.map(h => h.textContent)") == ["rope", "alibi"]
    assert len(page.query_selector_all(".run svg")) == 2  # the gradient-norm bars of each run
    page.click("nav a[data-step='attn.scores']")
    assert status(page).startswith("step=attn.scores")
    assert len(page.query_selector_all(".run canvas")) >= 2
    assert errors == []
    page.close()


def test_the_inside_steps_draw_the_lens_table_the_attribution_bars_and_the_patching_maps(browser, tmp_path):
    from qkv.explain import explain_page
    from tests.explain.test_inside import corrupted_text

    run = make_run(tmp_path / "rope", **VARIANTS["decoder-rope"])
    explain_page([run.path], PROMPT, out=tmp_path / "p.html", corrupt=corrupted_text(run, PROMPT))
    page, errors = open_page(browser, tmp_path / "p.html", "#step=inside.lens")
    assert status(page).startswith("step=inside.lens")
    assert page.eval_on_selector_all("table.lens tr", "rows => rows.length") == 1 + 3  # header, embedding, 2 layers
    for step, canvases in (("inside.heads", 3), ("inside.dla", 2), ("inside.patching", 2)):
        page.click(f"nav a[data-step='{step}']")
        assert status(page).startswith(f"step={step} ")
        assert page.eval_on_selector_all("#content canvas", "c => c.length") == canvases, step
    page.click("nav a[data-step='inside.dla']")
    assert status(page).startswith("step=inside.dla ")
    assert page.eval_on_selector_all("table.attribution tr", "rows => rows.length") == 2 * 4 + 2  # heads, FFNs
    page.click("nav a[data-step='inside.patching']")
    assert "corrupted" in page.inner_text("#content") and errors == []
    page.close()
