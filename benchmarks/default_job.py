"""The default job's figures: held-out bits per character after 300 s and 600 s of training, and tokens/s.

    python benchmarks/default_job.py [--times 300 300 300 600] [--out-dir /tmp/qkv-bench] [--json results.json]

Each budget is a separate `qkv train` run of the `shakespeare` preset with `--max-time`, so the learning-rate
schedule is fitted to that budget; the score is `qkv eval` on the held-out works (a sliding window over the
whole text). Reference points on the same split, scored the same way: a char-level nanoGPT-style CPU recipe
(4 layers, 128 wide) reaches 2.26 bits/char after 300 s and 2.14 after 600 s on 2 cores.
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

REFERENCE = {300: 2.26, 600: 2.14}


def run(cmd: list[str]) -> str:
    return subprocess.run(cmd, check=True, capture_output=True, text=True).stdout


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--times", type=float, nargs="+", default=[300.0, 600.0])
    parser.add_argument("--out-dir", default=None)
    parser.add_argument("--json", default=None, help="also write the results here")
    parser.add_argument("--set", action="append", default=[], help="extra --set overrides for qkv train")
    args = parser.parse_args()
    out_dir = Path(args.out_dir or tempfile.mkdtemp(prefix="qkv-bench-"))
    rows = []
    for i, seconds in enumerate(args.times):  # a budget may repeat: each run has its own dir
        run_dir = out_dir / f"shakespeare-{int(seconds)}s-{i}"
        start = time.perf_counter()
        extra = [item for pair in (("--set", s) for s in args.set) for item in pair]
        summary = json.loads(run([sys.executable, "-m", "qkv", "train", "--preset", "shakespeare", "--out",
                                  str(run_dir), "--max-time", str(seconds), "--quiet", "--no-sample", "--json",
                                  *extra]).strip().splitlines()[-1])
        wall = time.perf_counter() - start
        scored = json.loads(run([sys.executable, "-m", "qkv", "eval", str(run_dir), "--json"]))
        rows.append({"train_seconds": seconds, "wall_seconds": round(wall, 1), "steps": summary["steps"],
                     "tokens_per_s": summary["tokens_per_s"], "bits_per_char": round(scored["bits_per_char"], 4),
                     "reference_bits_per_char": REFERENCE.get(int(seconds))})
    print(f"qkv default job, {platform.processor() or platform.machine()}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads")
    print(f"{'budget s':>9} {'steps':>7} {'tokens/s':>9} {'bits/char':>10} {'reference':>10}")
    for row in rows:
        print(f"{row['train_seconds']:>9.0f} {row['steps']:>7} {row['tokens_per_s']:>9,} "
              f"{row['bits_per_char']:>10.4f} {row['reference_bits_per_char'] or '':>10}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
