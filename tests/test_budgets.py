"""The size budgets of DESIGN.md: every source file under 400 lines (split a file by concept before then), and
the tests and benchmarks held to the same budget."""
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "qkv"
FILES = sorted(SRC.rglob("*.py")) + sorted((ROOT / "tests").rglob("*.py")) + sorted((ROOT / "benchmarks").rglob("*.py"))


def test_the_source_tree_is_found():
    assert len(FILES) > 150 and (SRC / "config.py") in FILES and Path(__file__) in FILES


@pytest.mark.parametrize("path", FILES, ids=[str(p.relative_to(ROOT)) for p in FILES])
def test_every_file_is_under_400_lines(path):
    lines = path.read_text(encoding="utf-8").count("\n")
    assert lines < 400, f"{path.relative_to(ROOT)} has {lines} lines: split it by concept"
