"""qkv explain: one model, one text, the notes' forward and backward passes step by step, every number the
reference engine's (qkv.explain.trace), in one self-contained HTML page (qkv.explain.page).

    path = explain_page(["runs/shakespeare"], "To be, or not to be", target=" that", out="explain.html")
"""
from __future__ import annotations

from pathlib import Path

from qkv.errors import QkvError
from qkv import files
from qkv.explain.inside import look_inside
from qkv.explain.page import build_page
from qkv.explain.trace import trace
from qkv.formats import load, merge_adapter
from qkv.generate.weights import round_weights

DOCS = Path(__file__).resolve().parents[3] / "docs" / "derivations"  # a checkout's pages (linked when present)


def explain_page(runs: list[str | Path], text: str, *, target: str | None = None, out: str | Path = "explain.html",
                 dtype: str = "fp32", quant: str = "none", corrupt: str | None = None,
                 adapter: str | None = None) -> tuple[Path, int]:
    """Trace each run on `text` and write the page; returns (path, size in bytes). `out` is written whole
    or not at all. `dtype` / `quant`: the weights as they are at that precision (qkv.generate.weights.round_weights),
    which the page's summary states. A decoder's page also shows what it does inside (qkv.explain.inside), with
    activation patching against `corrupt`. `adapter`: a LoRA adapter merged into the first run (explain BASE
    --adapter A --compare BASE shows what the adapter changed)."""
    out = Path(out)
    if out.is_dir():
        raise QkvError(f"--out {out}: is a directory")
    if out.suffix.lower() not in (".html", ".htm"):
        raise QkvError(f"--out {out}: the page is HTML; name it *.html")
    explanations = []
    for i, path in enumerate(runs):
        run = load(path)
        adapted = adapter is not None and i == 0
        if adapted:
            merge_adapter(run, adapter)
        precision = round_weights(run.model, dtype=dtype, quant=quant)
        explanation = trace(run, text, target)
        look_inside(run, explanation, corrupt)
        explanation.meta["precision"] = precision or "fp32 weights"
        if precision:
            explanation.meta["summary"] += f"; {precision}"
        if adapted:
            explanation.meta["summary"] += f"; LoRA adapter {Path(adapter).name} merged"
        explanations.append(explanation)
    page = build_page(explanations, DOCS)
    files.write_text_atomic(out, page)
    return out, len(page.encode("utf-8"))
