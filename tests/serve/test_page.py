"""The playground page in headless Chromium (Playwright): it connects, streams a completion token by token,
shows each token's probability and alternatives on hover, and logs no error."""
from tests.analysis.test_plots import not_blank
from tests.serve.live import Live, write_run
from tests.serve.test_server import expected

from tests.browser import FLAGS


def test_playground_streams_a_completion_and_shows_token_probabilities(tmp_path, chromium):
    from playwright.sync_api import sync_playwright

    import qkv

    path = write_run(tmp_path / "tiny")
    run = qkv.load(path)
    with Live(path) as server, sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=FLAGS)
        page = browser.new_page(viewport={"width": 1100, "height": 700})
        problems = []
        page.on("console", lambda m: problems.append(m.text) if m.type == "error" else None)
        page.on("pageerror", lambda e: problems.append(str(e)))
        page.goto(server.url + "/")
        page.wait_for_selector('body[data-ready="1"]')
        assert "tiny" in page.inner_text("#model")
        page.fill("#prompt", "the cat")
        page.eval_on_selector("#temperature", "el => { el.value = '0'; el.dispatchEvent(new Event('input')); }")
        page.eval_on_selector("#max_tokens", "el => { el.value = '24'; el.dispatchEvent(new Event('input')); }")
        page.click("#send")
        page.wait_for_selector('body[data-done="1"]', timeout=30000)
        shown = page.eval_on_selector("body", "el => el.dataset.text")
        assert shown == expected(run, "the cat", 24)  # the greedy text `qkv generate` prints
        assert "tokens in" in page.inner_text("#status")
        spans = page.query_selector_all("#out .tok[data-p]")
        assert len(spans) >= 1
        spans[0].hover()
        tip = page.wait_for_selector("#tip", state="visible")
        assert tip.inner_text().startswith("p(") and len(tip.query_selector_all("tr")) >= 1
        shot = tmp_path / "playground.png"
        page.screenshot(path=str(shot))
        browser.close()
    assert not problems, problems
    assert not_blank(shot)
