"""qkv.analysis.attention_html: the interactive attention page is self-contained, carries the maps it was
given (to its stated 4 decimals) and, where Chromium is installed, renders and responds in a headless browser."""
import json
import re
import subprocess

import numpy as np

from qkv.analysis import attention_html
from tests.analysis.test_plots import not_blank
from tests.browser import require_chromium


def sample_page(tmp_path):
    rng = np.random.default_rng(0)
    maps = [rng.dirichlet(np.ones(6), size=(3, 6)) for _ in range(2)]  # (H=3, T=6, T=6) per layer
    tokens = ["The", " cat", "</script>", " sat", " on", " it"]
    return attention_html.write(maps, tokens, ["layer 0", "layer 1"], tmp_path / "page.html"), maps, tokens


def test_page_is_self_contained(tmp_path):
    path, maps, tokens = sample_page(tmp_path)
    text = path.read_text()
    assert not re.search(r"https?://|<script[^>]+src=|<link[^>]+href=|@import", text)
    assert text.count("</script>") == 2  # the token "</script>" is escaped inside the data block


def headless(*args, timeout=60) -> subprocess.CompletedProcess:
    return subprocess.run([require_chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
                           "--disable-extensions", *args], capture_output=True, text=True, timeout=timeout)


def test_page_in_headless_chromium(tmp_path, chromium):
    """The page's script runs offline: layer/head/token from the URL fragment drive the same code as the
    selects and hover; the status names the key that token attends to most; a screenshot is not blank."""
    path, maps, tokens = sample_page(tmp_path)
    layer, head, token = 1, 2, 4
    url = f"{path.as_uri()}#layer={layer}&head={head}&token={token}"
    dom = headless("--dump-dom", url).stdout
    assert 'data-ready="1"' in dom
    best = int(np.argmax(maps[layer][head][token]))
    status = re.search(r'<div id="status" data-best="(\d+)">([^<]*)</div>', dom)
    assert status and int(status.group(1)) == best
    assert f"token {token}" in status.group(2) and f"most to token {best}" in status.group(2)
    assert dom.count('class="tok') == len(tokens)
    shot = tmp_path / "shot.png"
    headless(f"--screenshot={shot}", "--window-size=900,700", url)
    assert shot.is_file() and not_blank(shot)


def test_the_page_carries_the_maps_tokens_and_names(tmp_path):
    path, maps, tokens = sample_page(tmp_path)
    block = re.search(r'<script type="application/json" id="attention-data">(.*?)</script>', path.read_text(), re.S)
    data = json.loads(block.group(1).replace("<\\/", "</"))
    assert data["tokens"] == tokens and data["names"] == ["layer 0", "layer 1"]
    for got, want in zip(data["maps"], maps):
        np.testing.assert_allclose(got, want, rtol=0, atol=5e-5)  # rounded to 4 decimals
        np.testing.assert_allclose(np.sum(got, axis=-1), 1.0, atol=6 * 5e-5)
