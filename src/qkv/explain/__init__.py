"""qkv explain: one model, one text, the notes' forward and backward passes step by step, every number the
reference engine's (qkv.explain.trace), in one self-contained HTML page (qkv.explain.page).

    path = explain_page(["runs/shakespeare"], "To be, or not to be", target=" that", out="explain.html")
"""
from __future__ import annotations

from pathlib import Path

from qkv.errors import QkvError
from qkv import files
from qkv.explain.page import build_page
from qkv.explain.trace import trace
from qkv.formats import load

DOCS = Path(__file__).resolve().parents[3] / "docs" / "derivations"  # a checkout's pages (linked when present)


def explain_page(runs: list[str | Path], text: str, *, target: str | None = None, out: str | Path = "explain.html"
                 ) -> tuple[Path, int]:
    """Trace each run on `text` and write the page; returns (path, size in bytes). `out` is written whole
    or not at all."""
    out = Path(out)
    if out.is_dir():
        raise QkvError(f"--out {out}: is a directory")
    if out.suffix.lower() not in (".html", ".htm"):
        raise QkvError(f"--out {out}: the page is HTML; name it *.html")
    explanations = [trace(load(run), text, target) for run in runs]
    page = build_page(explanations, DOCS)
    files.write_text_atomic(out, page)
    return out, len(page.encode("utf-8"))
