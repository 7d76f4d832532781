"""Reference engine: attention memory, naive vs tiled flash, and training-step time vs torch eager.

1. Peak bytes NumPy allocates during one causal attention forward + backward (B = H = 1, Dh = 64) at
   n = 256, 1024, 4096, for the naive kernel (the (n, n) scores and weights: O(n^2)) and the tiled flash
   kernel (log-sum-exp and row dots plus one tile: O(n), on top of the O(n Dh) outputs), measured with
   tracemalloc; the growth factor per 4x n shows the exponent (16x = quadratic, 4x = linear).
2. One training step (forward, backward, clipping, AdamW) on the `tiny` preset, both engines in float64
   from the same weights and batch: median seconds over repeats, ratio reference / torch.

    PYTHONPATH=src python benchmarks/ref_memory.py [--sizes 256 1024 4096] [--repeats 5] [--threads 1]
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch
import torch.nn.functional as F

import qkv
from qkv.formats.params import to_numpy, torch_adamw
from qkv.ref.gradcheck import attention_peak_bytes
from qkv.ref.optim import OPTIMIZERS
from qkv.ref.train import train_step


def memory_table(sizes: list[int], head_dim: int, block: int) -> None:
    print(f"attention forward+backward peak allocation (B=H=1, Dh={head_dim}, flash tile {block}x{block})")
    print(f"{'n':>6} {'naive MiB':>10} {'flash MiB':>10} {'naive/flash':>12} {'naive x':>8} {'flash x':>8}")
    previous = None
    for n in sizes:
        naive = attention_peak_bytes("naive", n, d=head_dim, block=block)
        flash = attention_peak_bytes("flash", n, d=head_dim, block=block)
        growth = ("", "") if previous is None else (f"{naive / previous[0]:.1f}", f"{flash / previous[1]:.1f}")
        print(f"{n:>6} {naive / 2**20:>10.1f} {flash / 2**20:>10.2f} {naive / flash:>12.1f} "
              f"{growth[0]:>8} {growth[1]:>8}")
        previous = (naive, flash)
    print("(x: growth from the previous row; n grows 4x per row: quadratic shows 16x, linear 4x)\n")


def step_times(repeats: int) -> None:
    cfg = qkv.presets.get("tiny")
    tc, mc = cfg.train, cfg.model
    torch.manual_seed(0)
    model = qkv.build_model(mc).double()
    params = to_numpy(model)
    rng = np.random.default_rng(0)
    x, y = rng.integers(0, mc.vocab_size, (2, tc.batch_size, tc.seq_len))
    optimizer_t, optimizer_r = torch_adamw(model, tc), OPTIMIZERS.get("adamw")(tc)
    xt, yt = torch.from_numpy(x), torch.from_numpy(y)

    def torch_step():
        loss = F.cross_entropy(model(xt).flatten(0, 1), yt.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), tc.grad_clip)
        optimizer_t.step()
        optimizer_t.zero_grad()

    def ref_step():
        train_step(params, mc, tc, optimizer_r, x, y, tc.lr)

    times = {"torch": [], "ref": []}
    for _ in range(repeats):  # alternate A B A B so load changes hit both
        for name, step in (("torch", torch_step), ("ref", ref_step)):
            start = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - start)
    t_torch, t_ref = statistics.median(times["torch"]), statistics.median(times["ref"])
    print(f"training step on 'tiny' (B={tc.batch_size}, T={tc.seq_len}, D={mc.d_model}, L={mc.n_layers}), float64, "
          f"median of {repeats}")
    print(f"{'engine':>8} {'ms/step':>9}")
    print(f"{'torch':>8} {t_torch * 1e3:>9.1f}\n{'ref':>8} {t_ref * 1e3:>9.1f}")
    print(f"ratio ref / torch: {t_ref / t_torch:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[256, 1024, 4096])
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--block", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    memory_table(args.sizes, args.head_dim, args.block)
    step_times(args.repeats)


if __name__ == "__main__":
    main()
