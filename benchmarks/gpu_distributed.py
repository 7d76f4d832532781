"""Data parallel and ZeRO 0-3 on several GPUs (NCCL, bf16): memory per GPU and throughput, one command.

    PYTHONPATH=src python benchmarks/gpu_distributed.py [--gpus N] [--preset gpt2-124m] [--batch 32] [--seq 1024]

For one GPU and for dp=N with zero 0, 1, 2, 3 it launches torchrun with N processes; each trains the preset
(bf16 autocast, fp32 master weights, AdamW; activation checkpointing with --checkpointing) for --steps steps
on random tokens and reports torch.cuda.max_memory_allocated over the timed steps, next to
`qkv calc`'s figures for the same setup (qkv.analysis.memory.training), and tokens/s of the whole job with
its ratio to one GPU (ideal: N). NCCL is chosen automatically on CUDA (qkv.parallel.layout.setup).
Without at least two CUDA GPUs it says so and exits 2; on CPU use benchmarks/distributed.py.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

GiB = 2**30


def run_config(args, dp: int, zero: int):
    import dataclasses

    from qkv import presets
    from qkv.config import ParallelConfig

    cfg = presets.get(args.preset)
    train = dataclasses.replace(cfg.train, batch_size=args.batch, seq_len=args.seq, precision="bf16", device="cuda",
                                accumulation=1, activation_checkpointing=args.checkpointing, threads=0)
    model = dataclasses.replace(cfg.model, dropout=0.0)
    return dataclasses.replace(cfg, model=model, train=train, parallel=ParallelConfig(dp=dp, zero=zero))


def worker(args) -> None:
    import torch

    from qkv.data.dataset import Prepared
    from qkv.train.loop import Trainer

    cfg = run_config(args, args.dp, args.zero)
    tokens = np.random.default_rng(0).integers(0, cfg.model.vocab_size, 2_000_000).astype(np.uint32)
    data = Prepared(tokenizer=None, train=tokens, val=tokens[:100_000], val_chars=100_000, cache_dir=Path("."))
    trainer = Trainer(Path(tempfile.mkdtemp()), cfg, data, progress=False, log=lambda message: None)
    times = []
    for i in range(args.steps + 2):  # two warm-up steps (allocator, NCCL communicators, kernels)
        if i == 2:
            torch.cuda.reset_peak_memory_stats(trainer.device)
        batch = [torch.from_numpy(trainer.layout.shard(a)).to(trainer.device) for a in trainer.batches.next()]
        torch.cuda.synchronize(trainer.device)
        start = time.perf_counter()
        trainer.step(*batch, lr=1e-4)
        torch.cuda.synchronize(trainer.device)
        times.append(time.perf_counter() - start)
    result = {"rank": trainer.layout.rank, "peak": torch.cuda.max_memory_allocated(trainer.device),
              "seconds": statistics.median(times[2:])}
    Path(args.out, f"rank{trainer.layout.rank}.json").write_text(json.dumps(result))
    trainer.gather()


def calc(args, dp: int, zero: int) -> dict:
    from qkv.analysis import memory

    cfg = run_config(args, dp, zero)
    setup = memory.Setup(batch=args.batch // dp, seq=args.seq, precision="bf16", zero=zero, gpus=dp,
                         checkpointing=args.checkpointing)
    return memory.training(cfg.model, setup)


def launch(args, dp: int, zero: int) -> list[dict]:
    with tempfile.TemporaryDirectory() as out:
        worker_args = [str(Path(__file__).resolve()), "--worker", "--dp", str(dp), "--zero", str(zero), "--out", out,
                       "--preset", args.preset, "--batch", str(args.batch), "--seq", str(args.seq),
                       "--steps", str(args.steps)] + (["--checkpointing"] if args.checkpointing else [])
        launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(dp)]
        proc = subprocess.run(launcher + worker_args, env=dict(os.environ), capture_output=True, text=True)
        if proc.returncode:
            sys.exit(f"dp={dp} zero={zero} failed:\n{proc.stderr[-4000:]}")
        return [json.loads(path.read_text()) for path in sorted(Path(out).glob("rank*.json"))]


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gpus", type=int, help="data-parallel GPUs (default: all visible)")
    parser.add_argument("--preset", default="gpt2-124m")
    parser.add_argument("--batch", type=int, default=32, help="global batch (rows); divisible by --gpus")
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--checkpointing", action="store_true", help="activation checkpointing")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--dp", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--zero", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    return parser.parse_args()


def main() -> None:
    args = parse()
    if args.worker:
        return worker(args)
    import torch

    found = torch.cuda.device_count() if torch.cuda.is_available() else 0
    gpus = args.gpus or found
    if found < 2 or gpus < 2 or gpus > found:
        print(f"gpu_distributed.py: needs at least 2 CUDA GPUs (asked for {gpus}, found {found}); "
              f"on CPU run benchmarks/distributed.py", file=sys.stderr)
        sys.exit(2)
    if args.batch % gpus:
        sys.exit(f"gpu_distributed.py: --batch {args.batch} must divide by --gpus {gpus}")
    print(f"{args.preset}, bf16 autocast + fp32 master weights, AdamW, global batch {args.batch} x {args.seq}, "
          f"{torch.cuda.get_device_name(0)}; GiB per GPU (rank 0)")
    print(f"{'mode':<12} {'peak':>7} {'calc':>7} {'states calc':>12} {'s/step':>7} {'tokens/s':>10} {'x 1 GPU':>8}")
    base = None
    for dp, zero in [(1, 0)] + [(gpus, z) for z in range(4)]:
        ranks, want = launch(args, dp, zero), calc(args, dp, zero)
        seconds = max(r["seconds"] for r in ranks)
        rate = args.batch * args.seq / seconds
        base = base or rate
        states = sum(want[k] for k in ("weights", "gradients", "master_weights", "optimizer_states"))
        name = "1 GPU" if dp == 1 else f"dp={dp} zero={zero}"
        print(f"{name:<12} {ranks[0]['peak'] / GiB:>7.2f} {want['total'] / GiB:>7.2f} {states / GiB:>12.2f} "
              f"{seconds:>7.3f} {rate:>10,.0f} {rate / base:>8.2f}")


if __name__ == "__main__":
    main()
