"""The Folio job's figures: aligned lines, wall time, held-out chrF and exact-line accuracy against copying.

    python benchmarks/folio_job.py [--max-time 300] [--max-steps N] [--out-dir /tmp/qkv-bench] [--json results.json]

One `qkv train --preset folio` run (modern -> First Folio spelling, docs/tasks.md "Modern to First Folio"); by
default the preset's own 300 s budget, or --max-steps updates without a time limit (figures that do not
depend on how loaded the machine is). The train summary holds the beam-search chrF and exact-line accuracy on
held-out pairs and the copy-the-input baseline on the same pairs; the alignment's line counts come from
qkv.data.folio. Pass --set train.threads=1 on a machine shared with other jobs.
"""
from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from qkv.data import folio


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-time", type=float, default=None, help="seconds of training (default: the preset's)")
    parser.add_argument("--max-steps", type=int, default=None, help="updates, with no time limit")
    parser.add_argument("--out-dir", default=None)
    parser.add_argument("--json", default=None, help="also write the results here")
    parser.add_argument("--set", action="append", default=[], help="extra --set overrides for qkv train")
    args = parser.parse_args()
    rows = folio.report()
    aligned = {"pairs": sum(r["pairs"] for r in rows), "modern_lines": sum(r["modern_lines"] for r in rows),
               "folio_lines": sum(r["folio_lines"] for r in rows),
               "held_out_pairs": sum(r["pairs"] for r in rows if r["held_out"])}
    run_dir = Path(args.out_dir or tempfile.mkdtemp(prefix="qkv-bench-")) / "folio"
    limits = ["--max-time", str(args.max_time)] if args.max_time else []
    if args.max_steps:
        limits = ["--max-steps", str(args.max_steps), "--set", "train.max_time=0"]
    extra = [item for value in args.set for item in ("--set", value)]
    start = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "qkv", "train", "--preset", "folio", "--out", str(run_dir), "--quiet",
                          "--json", *limits, *extra], check=True, capture_output=True, text=True).stdout
    summary = json.loads(out.strip().splitlines()[-1])
    result = {"aligned": aligned, "wall_seconds": round(time.perf_counter() - start, 1), **summary}
    print(f"qkv Folio job, {platform.processor() or platform.machine()}, torch {torch.__version__}")
    print(f"aligned {aligned['pairs']:,} line pairs of {aligned['modern_lines']:,} modern / "
          f"{aligned['folio_lines']:,} Folio lines ({aligned['held_out_pairs']:,} in the held-out works)")
    print(f"{summary['steps']} updates, {summary['seconds']:.0f} s of training, {result['wall_seconds']:.0f} s in all")
    print(f"{'':>8} {'chrF':>7} {'exact':>7}")
    print(f"{'model':>8} {summary['val_chrf']:>7.2f} {summary['val_exact_accuracy']:>7.3f}")
    print(f"{'copy':>8} {summary['copy_chrf']:>7.2f} {summary['copy_exact_accuracy']:>7.3f}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
