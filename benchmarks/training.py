"""Training stack: activation checkpointing (memory and time) and mixed precision (loss curves).

1. Activation checkpointing (qkv.parallel.memory) on a configuration where activations dominate: T = 1024,
   D = 128, L = 4, H = 4, F = 512, B = 4, V = 256, fp32, AdamW. Each variant runs in a fresh subprocess:
   - kept MiB: bytes the autograd graph keeps for the backward after the forward (saved-tensor hooks),
   - peak MiB: growth of the process's peak RSS (ru_maxrss) over one whole training step (forward, backward,
     AdamW) above the RSS before it (the model, the batch); on CPU the allocator returns big blocks, so this
     is the step's peak working memory,
   - step s: in one further process, the three variants' steps interleaved, the fastest of `--repeats` each
     (1 torch thread; the minimum is the estimate least disturbed by other processes on a shared machine).
   Goal (issue 6): at least 50% less activation memory for at most 35% more time.
2. Mixed precision: the `tiny` preset for `--steps` steps on byte-level text (the bundled corpus's first
   400k characters as UTF-8 bytes, no tokenizer training) with fp32, bf16 and fp16 (autocast + GradScaler);
   prints the final losses and the largest gap to the fp32 curve (over a 10-step moving average) and saves
   the curves as a PNG at --out.

    PYTHONPATH=src python benchmarks/training.py [--part checkpointing|precision|all] [--steps 200]
        [--repeats 3] [--out training_precision.png]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

SEQ, WIDTH, LAYERS, HEADS, FFN, BATCH, VOCAB = 1024, 128, 4, 4, 512, 4, 256
VARIANTS = ("plain", "full", "save-attention")  # no checkpointing; every block; every block but attention


# ------------------------------------------------------------------------------- 1. activation checkpointing
def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def child(variant: str) -> dict:
    """One variant, measured in this (fresh) process."""
    import qkv
    from qkv.nn.linear_cross_entropy import cross_entropy
    from qkv.parallel.memory import apply_activation_checkpointing

    torch.set_num_threads(1)
    torch.manual_seed(0)
    cfg = qkv.ModelConfig(vocab_size=VOCAB, d_model=WIDTH, n_heads=HEADS, n_layers=LAYERS, d_ff=FFN,
                          max_seq_len=SEQ)
    model = qkv.build_model(cfg)
    if variant != "plain":
        apply_activation_checkpointing(model, save_attention=variant == "save-attention")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = torch.randint(0, VOCAB, (2, BATCH, SEQ))

    kept = 0

    def pack(tensor):
        nonlocal kept
        kept += tensor.numel() * tensor.element_size()
        return tensor

    def step(count: bool = False) -> None:
        hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t) if count else _null()
        with hooks:
            loss = cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    before = rss_bytes()
    step(count=True)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
    return {"kept": kept, "peak": peak}


def timing_child(repeats: int) -> dict:
    """Step times of the three variants in one process, interleaved (plain, full, save-attention, plain, ...)
    so that the load of other processes hits them alike; the fastest of `repeats` per variant."""
    import qkv
    from qkv.nn.linear_cross_entropy import cross_entropy
    from qkv.parallel.memory import apply_activation_checkpointing

    torch.set_num_threads(1)
    cfg = qkv.ModelConfig(vocab_size=VOCAB, d_model=WIDTH, n_heads=HEADS, n_layers=LAYERS, d_ff=FFN,
                          max_seq_len=SEQ)
    models = {}
    for name in VARIANTS:
        torch.manual_seed(0)
        models[name] = qkv.build_model(cfg)
        if name != "plain":
            apply_activation_checkpointing(models[name], save_attention=name == "save-attention")
    optimizers = {name: torch.optim.AdamW(m.parameters(), lr=1e-3) for name, m in models.items()}
    x, y = torch.randint(0, VOCAB, (2, BATCH, SEQ))
    times = {name: [] for name in VARIANTS}
    for _ in range(repeats + 1):  # the first round warms up
        for name, model in models.items():
            start = time.perf_counter()
            cross_entropy(model(x), y).backward()
            optimizers[name].step()
            optimizers[name].zero_grad(set_to_none=True)
            times[name].append(time.perf_counter() - start)
    return {name: min(values[1:]) for name, values in times.items()}  # min: the least disturbed by other load


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def checkpointing_table(repeats: int) -> None:
    # a fixed mmap threshold: glibc then returns every large block on free, so peak RSS tracks live memory
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": "65536"}
    results = {}
    for name in VARIANTS:
        out = subprocess.run([sys.executable, __file__, "--child", name, "--repeats", str(repeats)],
                             env=env, capture_output=True, text=True, check=True).stdout
        results[name] = json.loads(out.strip().splitlines()[-1])
    out = subprocess.run([sys.executable, __file__, "--child", "timing", "--repeats", str(repeats)],
                         env=env, capture_output=True, text=True, check=True).stdout
    for name, seconds in json.loads(out.strip().splitlines()[-1]).items():
        results[name]["seconds"] = seconds
    mib = 2 ** 20
    print(f"activation checkpointing: T={SEQ} D={WIDTH} L={LAYERS} H={HEADS} F={FFN} B={BATCH} V={VOCAB}, fp32, "
          f"1 thread")
    print(f"{'variant':<15} {'kept MiB':>9} {'peak MiB':>9} {'step s':>8}")
    for name, r in results.items():
        print(f"{name:<15} {r['kept'] / mib:>9.1f} {r['peak'] / mib:>9.1f} {r['seconds']:>8.3f}")
    plain = results["plain"]
    for name in VARIANTS[1:]:
        r = results[name]
        print(f"{name}: kept activations {100 * (r['kept'] / plain['kept'] - 1):+.0f}%, "
              f"peak step memory {100 * (r['peak'] / plain['peak'] - 1):+.0f}%, "
              f"step time {100 * (r['seconds'] / plain['seconds'] - 1):+.0f}%")
    print("(goal: at least -50% memory for at most +35% time)\n")


# ------------------------------------------------------------------------------------ 2. mixed precision
def byte_data():
    from qkv.data.corpus import bundled_split, join
    from qkv.data.dataset import Prepared

    train_docs, val_docs = bundled_split()
    train = np.frombuffer(join(train_docs)[:400_000].encode("utf-8"), dtype=np.uint8).astype(np.uint16)
    val = np.frombuffer(join(val_docs)[:40_000].encode("utf-8"), dtype=np.uint8).astype(np.uint16)
    return Prepared(tokenizer=None, train=train, val=val, val_chars=len(val), cache_dir=None)


def loss_curve(precision: str, steps: int, data, folder: Path) -> list[float]:
    from qkv import presets
    from qkv.train.loop import Trainer
    from qkv.train.metrics import MetricsLog

    cfg = presets.get("tiny")
    cfg = dataclasses.replace(
        cfg, model=dataclasses.replace(cfg.model, vocab_size=VOCAB),
        train=dataclasses.replace(cfg.train, precision=precision, max_steps=steps, log_every=1, device="cpu",
                                  threads=1, warmup_steps=20))
    run = folder / precision
    run.mkdir()
    trainer = Trainer(run, cfg, data, progress=False, log=lambda message: print("  " + message))
    start = time.perf_counter()
    summary = trainer.run()
    rows = [r for r in MetricsLog.read(run / "metrics.csv") if r["loss"]]
    print(f"  {precision}: {steps} steps in {time.perf_counter() - start:.1f} s, skipped {summary['skipped_steps']}"
          f", final val loss {summary['val_loss']:.4f}")
    return [float(r["loss"]) for r in rows]


def smooth(values: list[float], width: int = 10) -> np.ndarray:
    return np.convolve(values, np.ones(width) / width, mode="valid")


def precision_table(steps: int, out: Path) -> None:
    data = byte_data()
    with tempfile.TemporaryDirectory() as folder:
        curves = {p: loss_curve(p, steps, data, Path(folder)) for p in ("fp32", "bf16", "fp16")}
    reference = smooth(curves["fp32"])
    print(f"mixed precision: tiny preset, {steps} steps, byte-level text (V={VOCAB}), CPU autocast")
    print(f"{'precision':<10} {'final loss':>10} {'last-10 mean':>12} {'max |gap| to fp32':>18}")
    for name, curve in curves.items():
        gap = np.abs(smooth(curve) - reference).max()
        print(f"{name:<10} {curve[-1]:>10.4f} {np.mean(curve[-10:]):>12.4f} {gap:>18.4f}")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, curve in curves.items():
        ax.plot(range(1, len(curve) + 1), curve, label=name, linewidth=1)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (nats/token)")
    ax.set_title(f"tiny preset: fp32 vs bf16 vs fp16 autocast ({steps} steps)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    print(f"curves saved to {out}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=("checkpointing", "precision", "all"), default="all")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("training_precision.png"))
    parser.add_argument("--child", choices=(*VARIANTS, "timing"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        result = timing_child(args.repeats) if args.child == "timing" else child(args.child)
        print(json.dumps(result))
        return
    torch.set_num_threads(1)
    if args.part in ("checkpointing", "all"):
        checkpointing_table(args.repeats)
    if args.part in ("precision", "all"):
        precision_table(args.steps, args.out)


if __name__ == "__main__":
    main()
