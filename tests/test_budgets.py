"""The size budgets of DESIGN.md: every source file under 400 lines (split a file by concept before then)."""
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "qkv"
FILES = sorted(SRC.rglob("*.py"))


def test_the_source_tree_is_found():
    assert len(FILES) > 50 and (SRC / "config.py") in FILES


@pytest.mark.parametrize("path", FILES, ids=[str(p.relative_to(SRC)) for p in FILES])
def test_every_source_file_is_under_400_lines(path):
    lines = path.read_text(encoding="utf-8").count("\n")
    assert lines < 400, f"{path.relative_to(SRC)} has {lines} lines: split it by concept"
