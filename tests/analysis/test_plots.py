"""Figures (SPEC F2): each PNG is written and not blank; attention maps come from the recording kernel
(rows sum to 1, causal, the model's output unchanged, kernels restored); the interactive page is
self-contained and, where Chromium is installed, renders and responds in a headless browser."""
import re
import shutil
import subprocess

import matplotlib.image
import numpy as np
import pytest
import torch

import qkv
from qkv.analysis import attention_html
from qkv.analysis.record import attention_maps
from qkv.config import ModelConfig
from tests.analysis import run_cli
from tests.train import setup_env, trained_run


def not_blank(path) -> bool:
    image = matplotlib.image.imread(str(path))
    return image.shape[0] > 100 and float(image[..., :3].std()) > 0.02


@pytest.mark.parametrize("kernel", ["sdpa", "naive", "flash"])
def test_attention_maps_from_the_recording_kernel(kernel):
    cfg = ModelConfig(vocab_size=50, d_model=32, n_heads=4, n_layers=2, d_ff=64, attention=kernel)
    model = qkv.build_model(cfg).eval()
    ids = torch.randint(0, 50, (1, 9), generator=torch.Generator().manual_seed(0))
    kernels = [block.attn.kernel for block in model.blocks]
    before = model(ids)
    maps = attention_maps(model, ids)
    assert list(maps) == ["blocks.0.attn", "blocks.1.attn"]
    for weights in maps.values():
        assert weights.shape == (4, 9, 9)
        assert torch.allclose(weights.sum(-1), torch.ones(4, 9), atol=1e-5)
        assert weights.triu(1).abs().max() == 0  # causal: no query sees a later key
    assert torch.equal(model(ids), before)
    assert [block.attn.kernel for block in model.blocks] == kernels


def test_attention_maps_of_encoder_families():
    from qkv.models.build import ARCHITECTURES

    if "encoder-decoder" not in ARCHITECTURES.names():
        pytest.skip("no encoder-decoder family yet")
    cfg = ModelConfig(arch="encoder-decoder", vocab_size=50, d_model=32, n_heads=4, n_layers=1, d_ff=64)
    src, tgt = torch.randint(0, 50, (2, 1, 6), generator=torch.Generator().manual_seed(0))
    maps = attention_maps(qkv.build_model(cfg), src, tgt[:, :5])
    assert list(maps) == ["encoder.blocks.0.attn", "blocks.0.attn", "blocks.0.cross_attn"]
    assert maps["encoder.blocks.0.attn"].triu(1).abs().max() > 0  # bidirectional
    assert maps["blocks.0.cross_attn"].shape == (4, 5, 6)  # target queries over source keys
    for weights in maps.values():
        assert torch.allclose(weights.sum(-1), torch.ones(weights.shape[:-1]), atol=1e-5)


def test_plot_commands(tmp_path):
    for figure, extra in (("pe", ["--d-model", "32"]), ("rope", []), ("lr", ["--preset", "tiny"]),
                          ("gradnorm", ["--layers", "3"])):
        rc, out, err = run_cli("plot", figure, *extra, "--out", tmp_path / f"{figure}.png")
        assert rc == 0, err
        assert out.strip() == str(tmp_path / f"{figure}.png") and not_blank(out.strip())
    rc, _, err = run_cli("plot", "lr", "--schedule", "nope", "--out", tmp_path / "x.png")
    assert rc == 2 and "choose from" in err and err.count("\n") == 1


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        setup_env(mp, tmp_path_factory)
        return trained_run(tmp_path_factory)[0]


def test_loss_and_attention_from_a_run(run, tmp_path):
    rc, out, err = run_cli("plot", "loss", run, "--out", tmp_path / "loss.png")
    assert rc == 0 and not_blank(tmp_path / "loss.png"), err
    rc, out, err = run_cli("plot", "attention", run, "--text", "The moon doth sing", "--out", tmp_path / "a.png",
                           "--html", tmp_path / "a.html")
    assert rc == 0, err
    assert out.split() == [str(tmp_path / "a.png"), str(tmp_path / "a.html")]
    assert not_blank(tmp_path / "a.png")
    rc, _, err = run_cli("plot", "attention", tmp_path / "missing", "--text", "x", "--out", tmp_path / "b.png")
    assert rc == 2 and err.startswith("qkv: error:")


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


CHROMIUM = next((shutil.which(name) for name in ("chromium", "chromium-browser", "google-chrome")
                 if shutil.which(name)), None)


def headless(*args, timeout=60) -> subprocess.CompletedProcess:
    return subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
                           "--disable-extensions", *args], capture_output=True, text=True, timeout=timeout)


@pytest.mark.skipif(CHROMIUM is None, reason="no chromium on PATH (apt-get install chromium) for the browser test")
def test_page_in_headless_chromium(tmp_path):
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
