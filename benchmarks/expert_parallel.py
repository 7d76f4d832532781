"""Expert parallel against plain data parallel on the same launch (docs/distributed.md): `qkv train` under
torchrun with parallel.dp=2, then dp=2 x ep=2, alternating, on an MoE model (the tiny preset at d_model 256, 8
heads, 8 layers, d_ff 1024, 4 experts of top 2 in every layer) for 30 steps of 16 x 64 tokens each, on verse the
tests use. Reported: each run's tokens/s and final validation loss as `qkv train --json` prints them, and the
ratio of the medians.

    PYTHONPATH=src:. python benchmarks/expert_parallel.py [--rounds 2] [--processes 2]
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

from tests.train import benchmark_folder

REPO = Path(__file__).resolve().parents[1]
MODEL = ["model.d_model=256", "model.n_heads=8", "model.n_layers=8", "model.d_ff=1024", "model.moe_experts=4",
         "model.moe_top_k=2", "data.vocab_size=280", "train.max_steps=30", "train.eval_every=0",
         "train.batch_size=16", "train.seq_len=64", "train.threads=1"]


def run(out: Path, text: Path, processes: int, sets: list[str], env: dict) -> dict:
    cli = ["train", "--preset", "tiny", "--data", str(text), "--out", str(out), "--quiet", "--no-sample", "--json",
           *[item for s in MODEL + sets for item in ("--set", s)]]
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                           str(processes), "-m", "qkv", *cli], cwd=REPO, env=env, capture_output=True, text=True,
                          check=True)
    return json.loads(next(line for line in done.stdout.splitlines() if line.startswith("{")))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--processes", type=int, default=2)
    args = parser.parse_args()
    out, text, env = benchmark_folder("qkv-expert-parallel-")
    layouts = {"dp": [f"parallel.dp={args.processes}"],
               "dp x ep": [f"parallel.dp={args.processes}", f"parallel.ep={args.processes}"]}
    rates: dict[str, list[float]] = {name: [] for name in layouts}
    print("| run | layout | tokens/s | validation loss |\n|---|---|---|---|")
    for round_ in range(args.rounds):
        for name, sets in layouts.items():
            summary = run(out / f"{name.replace(' ', '')}-{round_}", text, args.processes, sets, env)
            rates[name].append(summary["tokens_per_s"])
            print(f"| {round_ + 1} | {name} | {summary['tokens_per_s']:,.0f} | {summary['val_loss']:.4f} |")
    ratio = statistics.median(rates["dp x ep"]) / statistics.median(rates["dp"])
    print(f"\nexpert parallel / data parallel, median tokens/s: {ratio:.2f}x")


if __name__ == "__main__":
    main()
