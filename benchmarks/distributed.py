"""Memory per rank of each data-parallel mode on CPU (gloo), next to `qkv calc`'s figures (docs/distributed.md).

For one process and for dp=2 with zero 0, 1, 2, 3 (torchrun, 2 processes), each rank trains a decoder of
about 27M parameters for a few steps (fp32, AdamW) and reports:
- counted: the bytes of its own weights, gradients (at the optimizer step) and Adam moments, local shards
  only: what ZeRO shards (note 000 LLM §7.3), the quantity qkv.analysis.memory.model_states predicts;
- peak: its peak resident memory during the steps (VmHWM, reset after a warm-up step) minus its resident
  memory before the model was built: states, activations, communication buffers and allocator slack;
- calc: qkv.analysis.memory.training for the same model, rows per rank, precision and ZeRO stage;
- seconds per step (median), taken while the two ranks share the machine's cores.

    PYTHONPATH=src python benchmarks/distributed.py [--d-model 512] [--layers 8] [--steps 4]
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

MODES = [(1, 0), (2, 0), (2, 1), (2, 2), (2, 3)]  # (dp, zero)
MiB = 2**20


def run_config(args, dp: int, zero: int):
    from qkv.config import ModelConfig, ParallelConfig, RunConfig, TrainConfig

    model = ModelConfig(vocab_size=4096, d_model=args.d_model, n_heads=8, n_layers=args.layers,
                        d_ff=4 * args.d_model, max_seq_len=args.seq, dropout=0.0)
    train = TrainConfig(batch_size=args.batch, seq_len=args.seq, threads=1, eval_batches=1)
    return RunConfig(model=model, train=train, parallel=ParallelConfig(dp=dp, zero=zero))


def status(field: str) -> int:
    """A VmRSS / VmHWM line of /proc/self/status, in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def local_bytes(tensors) -> int:
    from qkv.parallel.layout import is_dtensor

    return sum((t.to_local() if is_dtensor(t) else t).nbytes for t in tensors if t is not None)


def worker(args) -> None:
    import torch

    from qkv.data.dataset import Prepared
    from qkv.train.loop import Trainer

    dp, zero = args.dp, args.zero
    cfg = run_config(args, dp, zero)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, cfg.model.vocab_size, 100_000).astype(np.uint16)
    data = Prepared(tokenizer=None, train=tokens, val=tokens[:5000], val_chars=5000, cache_dir=Path("."))
    before = status("VmRSS")
    trainer = Trainer(Path(tempfile.mkdtemp()), cfg, data, progress=False, log=lambda message: None)
    grads = []
    step = trainer.optimizer.step

    def counted_step(*a, **k):  # the gradients as the optimizer sees them: full (DDP) or shards (FSDP2)
        grads.append(local_bytes(p.grad for p in trainer.model.parameters()))
        return step(*a, **k)

    trainer.optimizer.step = counted_step
    times = []
    for i in range(args.steps + 1):
        if i == 1:
            Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM: the peak of the steps that follow
        batch = [torch.from_numpy(trainer.layout.shard(a)) for a in trainer.batches.next()]
        start = time.perf_counter()
        trainer.step(*batch, lr=1e-4)
        times.append(time.perf_counter() - start)
    optim = trainer.optimizer.optim if zero == 1 else trainer.optimizer  # ZeRO-1: this rank's partition
    moments = [v for state in optim.state.values() for k, v in state.items() if k != "step"]
    result = {"rank": trainer.layout.rank, "weights": local_bytes(trainer.model.parameters()), "gradients": grads[-1],
              "optimizer_states": local_bytes(moments), "peak": status("VmHWM") - before,
              "seconds": statistics.median(times[1:])}
    Path(args.out, f"rank{trainer.layout.rank}.json").write_text(json.dumps(result))


def calc(args, dp: int, zero: int) -> dict:
    from qkv.analysis import memory, params

    cfg = run_config(args, dp, zero)
    setup = memory.Setup(batch=args.batch // dp, seq=args.seq, precision="fp32", zero=zero, gpus=dp)
    return {**memory.training(cfg.model, setup), "params": params.count(cfg.model)}


def launch(args, dp: int, zero: int) -> list[dict]:
    with tempfile.TemporaryDirectory() as out:
        worker_args = [str(Path(__file__).resolve()), "--worker", "--dp", str(dp), "--zero", str(zero),
                       "--out", out, "--d-model", str(args.d_model), "--layers", str(args.layers),
                       "--steps", str(args.steps), "--batch", str(args.batch), "--seq", str(args.seq)]
        launcher = ([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(dp)]
                    if dp > 1 else [sys.executable])
        # glibc returns freed blocks above a fixed threshold to the system at once (by default the threshold
        # grows after the first large free and freed memory stays resident): RSS then follows live tensors
        env = {**os.environ, "OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": str(1 << 17)}
        proc = subprocess.run(launcher + worker_args, env=env, capture_output=True, text=True)
        if proc.returncode:
            sys.exit(f"dp={dp} zero={zero} failed:\n{proc.stderr[-3000:]}")
        return [json.loads(path.read_text()) for path in sorted(Path(out).glob("rank*.json"))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--d-model", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--batch", type=int, default=4, help="global batch (rows)")
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--dp", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--zero", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    n = calc(args, 1, 0)["params"]
    print(f"decoder d_model={args.d_model} layers={args.layers}: {n / 1e6:.1f}M parameters, fp32 AdamW, "
          f"global batch {args.batch} x {args.seq}; MiB per rank (rank 0; rank 1 within a few %)")
    print(f"{'mode':<11} | {'weights':>15} | {'gradients':>15} | {'Adam m, v':>15} | {'states':>15} | "
          f"{'peak':>6} {'calc total':>10} | {'s/step':>6}")
    print(f"{'':<11} | {'counted  calc':>15} | {'counted  calc':>15} | {'counted  calc':>15} | "
          f"{'counted  calc':>15} | {'meas.':>6} {'':>10} |")
    for dp, zero in MODES:
        ranks = launch(args, dp, zero)
        want, got = calc(args, dp, zero), ranks[0]
        cells = [(got[k], want[k]) for k in ("weights", "gradients", "optimizer_states")]
        cells.append((sum(c[0] for c in cells), sum(c[1] for c in cells)))
        name = "1 process" if dp == 1 else f"dp=2 zero={zero}"
        print(f"{name:<11} | " + " | ".join(f"{a / MiB:>7.1f} {b / MiB:>7.1f}" for a, b in cells)
              + f" | {got['peak'] / MiB:>6.0f} {want['total'] / MiB:>10.0f} | {got['seconds']:>6.2f}")


if __name__ == "__main__":
    main()
