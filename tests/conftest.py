"""Shared fixtures: a tiny model config and a fixed torch seed for every test."""
import os
import shutil
import tempfile

# NumPy's BLAS threads compete with torch's on the shared cores (measured 3x slower reference steps).
for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")
# generate, chat and serve compile their decoding step in the background by default (qkv.generate.compiled): a
# compiler running beside every CLI test, in-process or not. The tests of that default set it back.
os.environ["QKV_COMPILE"] = "0"
# Inductor's compiled graphs for the whole run, every xdist worker (which inherits this from the controller), in
# one temporary directory, not the user's: a graph that several test files compile (the compiled step's tiny
# models, tests/generate/conftest.py) is built once and found by the others. Removed by the process that made it.
_MADE_INDUCTOR_DIR = "QKV_TEST_INDUCTOR" not in os.environ
if _MADE_INDUCTOR_DIR:
    os.environ["QKV_TEST_INDUCTOR"] = tempfile.mkdtemp(prefix="qkv-tests-inductor-")

import pytest  # noqa: E402
import torch  # noqa: E402

from qkv.config import ModelConfig  # noqa: E402

# Test tensors are tiny and the CI machines' cores are shared: with more than one intra-op thread each
# small op pays thread wake-ups, measured 10-50x slower under load. A test that needs threads sets them.
torch.set_num_threads(1)


def pytest_unconfigure(config):
    if _MADE_INDUCTOR_DIR:
        shutil.rmtree(os.environ["QKV_TEST_INDUCTOR"], ignore_errors=True)


@pytest.fixture(autouse=True)
def _seed_torch():
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _unwritten_cache_columns_are_nan(monkeypatch):
    """The KV cache allocates its columns without zeroing them (qkv.nn.cache.unwritten) and must never read one
    before writing it: in every test they start as NaN, which any such read would carry into the outputs."""
    import qkv.nn.cache

    monkeypatch.setattr(qkv.nn.cache, "unwritten",
                        lambda shape, *, dtype, device: torch.full(shape, float("nan"), dtype=dtype, device=device))


@pytest.fixture
def tiny_cfg() -> ModelConfig:
    """A model small enough that building, a forward and a backward take milliseconds."""
    return ModelConfig(vocab_size=32, d_model=16, n_heads=4, n_layers=2, d_ff=32, max_seq_len=32)


@pytest.fixture(scope="session")
def verified() -> list[dict]:
    """`qkv verify --json` once per session (about 15 s): tests/claims/test_verify.py reads the command's output,
    tests/claims/ checks each claim's measured figures against closed forms of its own."""
    import json

    from tests.analysis import run_cli

    rc, out, err = run_cli("verify", "--json")
    assert rc == 0, err
    return json.loads(out)


@pytest.fixture(scope="session")
def chromium() -> str:
    """The system's Chromium for the page tests (tests/browser.py): skips without one, fails so in CI."""
    from tests.browser import require_chromium

    return require_chromium()
