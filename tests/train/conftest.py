"""Fixtures of the launched training runs (tests/train/test_layouts.py, test_expert_parallel.py)."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.train import setup_env, shared_dir


@pytest.fixture(scope="module")
def text(tmp_path_factory) -> Path:
    """The verse file, and QKV_CACHE for this process and the ranks it launches (the same token cache)."""
    monkeypatch = pytest.MonkeyPatch()
    path = setup_env(monkeypatch, tmp_path_factory)
    os.environ["QKV_CACHE"] = str(shared_dir(tmp_path_factory, "cache"))  # the launched ranks read it too
    yield path
    monkeypatch.undo()
