"""`qkv verify`: the 31 claims of SPEC.md, each computed now (qkv.claims), never asserted.

    run(ids)  -> [{"id", "claim", "seed", "status", "measured", "note", "seconds"}]
    table(results) -> the readable report

status: `holds` (the note is right, and measured so), `corrected` (the note is wrong; the correct
statement was measured), `fails` (the measurement does not support the statement: a bug). A claim whose
computation raises is reported as `fails` with the error, so one broken claim never hides the others.
"""
from __future__ import annotations

import json
import math
import textwrap
import time

import torch

from qkv.claims import load_all
from qkv.errors import QkvError

STATUSES = ("holds", "corrected", "fails")


def _jsonable(value):
    """Plain JSON types: numpy scalars to float/int, tuples to lists, non-finite floats to strings."""
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if hasattr(value, "item") and not isinstance(value, (str, bytes)):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


def run_one(number: int) -> dict:
    spec = load_all()[number]
    start = time.perf_counter()
    try:
        result = spec.check()
        status, measured, note = result.status, result.measured, result.note
    except Exception as exc:  # a broken measurement is a failed claim, reported with its cause
        status, measured, note = "fails", {"error": f"{type(exc).__name__}: {exc}"}, "the computation raised"
    return {"id": number, "claim": spec.claim, "seed": spec.seed, "status": status,
            "measured": _jsonable(measured), "note": note, "seconds": round(time.perf_counter() - start, 2)}


def run(numbers: list[int] | None = None) -> list[dict]:
    """Compute the claims `numbers` (default all, in order) on one torch thread: the tensors are tiny,
    and more threads only add wake-ups on a shared machine."""
    claims = load_all()
    chosen = sorted(set(numbers)) if numbers else sorted(claims)
    unknown = [n for n in chosen if n not in claims]
    if unknown:
        raise QkvError(f"--claim {unknown[0]}: no such claim; choose from 1-{max(claims)}")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return [run_one(n) for n in chosen]
    finally:
        torch.set_num_threads(threads)


def _short(value) -> str:
    text = json.dumps(value)
    return text if len(text) <= 400 else text[:397] + "..."


def table(results: list[dict]) -> str:
    """One block per claim: id, status, the claim, the note's section, what was measured and the note."""
    lines = []
    for r in results:
        lines.append(f"[{r['id']:>2}] {r['status'].upper():<9} {r['claim']}  ({r['seed']})")
        for key, value in r["measured"].items():
            lines.append(textwrap.fill(f"{key}: {_short(value)}", width=110, initial_indent=" " * 15,
                                       subsequent_indent=" " * 17))
        if r["note"]:
            lines.append(textwrap.fill(r["note"], width=110, initial_indent=" " * 15, subsequent_indent=" " * 15))
    counts = {s: sum(r["status"] == s for r in results) for s in STATUSES}
    lines.append(f"{len(results)} claims: {counts['holds']} hold, {counts['corrected']} corrected, "
                 f"{counts['fails']} fail ({sum(r['seconds'] for r in results):.1f} s)")
    return "\n".join(lines)
