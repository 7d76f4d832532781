"""Memory per rank, measured against `qkv calc`: 2 gloo processes (tests/train/memory_worker.py) train one
step of each layout (ZeRO 0-3 over dp=2, tp=2, pp=2, expert parallel ep=2 with 4 experts) in fp32 and bf16 and record the bytes each rank holds
of weights (at the end of the forward), gradients (after the backward) and optimizer states (after the
update), then the whole step's peak for dp=2, tp=2 and pp=2 (1F1B and GPipe); beside them the
calculator's figure for the most loaded rank (qkv.analysis.memory). Markdown tables on stdout
(docs/distributed.md).

    PYTHONPATH=src:. python benchmarks/rank_memory.py [--set model.d_model=256 ...]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
from pathlib import Path

from qkv import presets
from qkv.analysis import calc, memory
from tests.train import benchmark_folder
from tests.train.memory_worker import LAYOUTS, PEAK_LAYOUTS, PEAK_SHAPE, PRECISIONS

REPO = Path(__file__).resolve().parents[1]
PARTS = ("weights", "gradients", "optimizer_states")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--set", action="append", default=["model.d_model=256", "model.n_heads=8",
                                                           "model.n_layers=8", "model.d_ff=1024"])
    args = parser.parse_args()
    out, text, env = benchmark_folder("qkv-rank-memory-")
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m",
                    "tests.train.memory_worker", str(out), str(text), *args.set], cwd=REPO, env=env, check=True)
    ranks = [json.loads((out / f"memory{r}.json").read_text()) for r in (0, 1)]
    print(f"settings: tiny preset + {' '.join(args.set)}; bytes per rank (rank 0 / rank 1), calc = `qkv calc` "
          "for the most loaded rank\n")
    print("| layout | precision | " + " | ".join(f"{part} measured | calc" for part in PARTS) + " |")
    print("|---|---|" + "---|---|" * len(PARTS))
    for name in LAYOUTS:
        sets = dict(item.split("=") for item in LAYOUTS[name])
        for precision in PRECISIONS:
            key = f"{name}/{precision}"
            model_sets = [item for item in LAYOUTS[name] if item.startswith("model.")]  # the ep layouts' experts
            cfg = presets.get("tiny").override(list(args.set) + model_sets).model
            cfg = dataclasses.replace(cfg, vocab_size=ranks[0][key]["vocab_size"])
            setup = memory.Setup(precision=precision, gpus=int(sets.get("parallel.dp", 1)),
                                 zero=int(sets.get("parallel.zero", 0)), tp=int(sets.get("parallel.tp", 1)),
                                 pp=int(sets.get("parallel.pp", 1)), ep=int(sets.get("parallel.ep", 1)))
            est = memory.training(cfg, setup)
            est = {"weights": est["weights"] + est["master_weights"], "gradients": est["gradients"],
                   "optimizer_states": est["optimizer_states"]}
            cells = []
            for part in PARTS:
                got = [rank[key][part] for rank in ranks]
                cells.append(f"{got[0] / 2**20:.3f} / {got[1] / 2**20:.3f} MiB | {est[part] / 2**20:.3f} MiB "
                             f"({est[part] / max(got):.3f})")
            print(f"| {name} | {precision} | " + " | ".join(cells) + " |")
    print("\nthe step's peak per rank (weights, states, gradients, activations; 16 x 64 tokens), rank 0 / rank 1, "
          "and `qkv calc`'s for the most loaded rank\n")
    print("| layout | precision | measured | calc |")
    print("|---|---|---|---|")
    for name, settings in PEAK_LAYOUTS.items():
        for precision in PRECISIONS:
            key = f"{name}/{precision}"
            cfg = presets.get("tiny").override([*args.set, *PEAK_SHAPE, f"train.precision={precision}", *settings])
            model = dataclasses.replace(cfg.model, vocab_size=ranks[0]["zero0/fp32"]["vocab_size"])
            est = memory.training(model, calc.setup_from(cfg))["total"]
            got = [rank["peak"][key] for rank in ranks]
            print(f"| {name} | {precision} | {got[0] / 2**20:.2f} / {got[1] / 2**20:.2f} MiB | "
                  f"{est / 2**20:.2f} MiB ({est / max(got):.2f}) |")


if __name__ == "__main__":
    main()
