"""The explanation as one self-contained HTML file: qkv/explain/page.html (style and script inline, nothing
fetched: it works opened from disk) with the data embedded as JSON in <script id="explain-data">.

Arrays travel as float32 rounded to nearest with MANTISSA_BITS of the 23 stored mantissa bits kept (relative
error <= 2^-18 = 3.8e-6, inside the 1e-5 the tests check the page against torch with; the dropped bits are
noise that would not compress). Each array's bytes are shuffled by byte position (all first bytes, then all
second bytes, ...: HDF5's "shuffle" filter, so the sign / exponent bytes sit together), deflated (zlib)
and base64-encoded; the page inflates them with the browser's DecompressionStream. An array equal to one
already stored (e.g. a Pre-LN norm's input, which is the stream itself) is stored once and aliased.
`read_data(html)` is the inverse, for tests and tools.

    data = {"runs": [run, ...], "steps": [...]}    # two runs with --compare, side by side
    run  = {"meta": {...}, "arrays": {name: {"shape": [...], "data": b64} | {"alias": other name}}}
"""
from __future__ import annotations

import base64
import hashlib
import json
import re
import zlib
from importlib import resources
from pathlib import Path

import numpy as np

from qkv.explain.steps import steps_for
from qkv.explain.trace import Explanation

DATA_TAG = '<script type="application/json" id="explain-data">'
BUDGET_BYTES = 5 * 2 ** 20  # 4 layers x 64 tokens of the shakespeare preset fit (docs/explain.md)
MANTISSA_BITS = 17
RELATIVE_ERROR = 2.0 ** -(MANTISSA_BITS + 1)


def round_mantissa(values: np.ndarray) -> np.ndarray:
    """float32 values rounded to nearest with MANTISSA_BITS mantissa bits (a carry moves into the exponent)."""
    bits = np.ascontiguousarray(values, dtype="<f4").view("<u4").astype(np.uint64)
    drop = 23 - MANTISSA_BITS
    rounded = ((bits + (1 << (drop - 1))) >> drop) << drop
    finite = np.isfinite(values)
    return np.where(finite, rounded, bits).astype("<u4").view("<f4").reshape(np.shape(values))


def encode_array(values: np.ndarray) -> dict:
    raw = round_mantissa(np.asarray(values, np.float32)).view(np.uint8).reshape(-1, 4).T.tobytes()  # shuffled
    return {"shape": list(values.shape), "data": base64.b64encode(zlib.compress(raw, 9)).decode("ascii")}


def decode_array(entry: dict) -> np.ndarray:
    raw = np.frombuffer(zlib.decompress(base64.b64decode(entry["data"])), np.uint8)
    return raw.reshape(4, -1).T.copy().view("<f4").reshape(entry["shape"])


def shown_names(steps: list[dict], explanation: Explanation) -> set[str]:
    """The arrays some panel shows, for this run's layers."""
    layers = range(len(explanation.meta["layers"]))
    names = set()
    for step in steps:
        for panel in step["panels"]:
            names.update(panel["array"].replace("{L}", str(n)) for n in layers)
    if explanation.meta["positional"] != "rope":  # q before the rotation is q itself
        names = {name for name in names if not name.endswith(".q_raw")}
    return names & set(explanation.arrays)


def run_data(explanation: Explanation, steps: list[dict]) -> dict:
    arrays, seen = {}, {}
    for name in sorted(shown_names(steps, explanation), key=_natural):
        values = np.asarray(explanation.arrays[name], dtype=np.float32)
        digest = hashlib.sha256(repr(values.shape).encode() + values.tobytes()).hexdigest()
        arrays[name] = {"alias": seen[digest]} if digest in seen else encode_array(values)
        seen.setdefault(digest, name)
    return {"meta": explanation.meta, "arrays": arrays}


def _natural(name: str):
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def build_page(explanations: list[Explanation], docs: Path | None = None) -> str:
    families = {e.meta["family"] for e in explanations}
    steps = _merge([steps_for(family) for family in sorted(families)])
    data = {"runs": [run_data(e, steps) for e in explanations], "steps": steps,
            "docs": docs.resolve().as_uri() + "/" if docs is not None and docs.is_dir() else None}
    text = json.dumps(data, separators=(",", ":"), allow_nan=False).replace("</", "<\\/")
    page = resources.files("qkv.explain").joinpath("page.html").read_text(encoding="utf-8")
    return page.replace("/*DATA*/", text, 1)


def _merge(lists: list[list[dict]]) -> list[dict]:
    """Steps of several families (--compare), each once, in the longest list's order."""
    longest = max(lists, key=len)
    ids = {step["id"] for step in longest}
    return longest + [step for steps in lists for step in steps if step["id"] not in ids]


def read_data(html: str) -> dict:
    """The page's embedded data with every array decoded: {"runs": [{"meta", "arrays": {name: ndarray}}]}."""
    start = html.index(DATA_TAG) + len(DATA_TAG)
    data = json.loads(html[start:html.index("</script>", start)].replace("<\\/", "</"))
    for run in data["runs"]:
        stored = run["arrays"]
        run["arrays"] = {name: decode_array(stored[entry.get("alias", name)]) for name, entry in stored.items()}
    return data
