"""Peak extra memory and time of every attention kernel's forward on CPU (no grad), causal, B = 1, H = 4,
Dh = 64, fp32, at n = 512, 2048, 8192; `model.window` = 256 for the sparse kinds.

Memory: each (kernel, n) runs in a fresh process with glibc's mmap threshold lowered (MALLOC_MMAP_THRESHOLD_),
so every large tensor is its own mapping and freeing it returns it; the peak resident set (ru_maxrss) minus
the resident set once q, k, v exist is the kernel's peak extra memory (intermediates and output). Time: the
median of --repeats calls after one warm-up call, one intra-op thread. A kernel whose estimated n x n
intermediates exceed --max-gib is skipped and its estimate reported.

    PYTHONPATH=src python benchmarks/attention_kernels.py [--sizes 512 2048 8192] [--repeats 3] [--max-gib 2]

With --backward: training instead: the bytes autograd saves for the backward of one call (counted exactly by
torch.autograd.graph.saved_tensors_hooks, inputs q, k, v included) and the time of forward + backward, at
n = 512 ... 4096 by default, with the growth per doubling of n (2 linear, 4 quadratic).

    PYTHONPATH=src python benchmarks/attention_kernels.py --backward [--sizes 512 1024 2048 4096]
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

HEADS, HEAD_DIM, WINDOW = 4, 64, 256


def quadratic_gib(n: int) -> float:
    """(B, H, n, n) fp32 scores, masked scores and weights: what the naive kernel holds at once."""
    return 3 * HEADS * n * n * 4 / 2**30


def resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def worker(name: str, n: int, repeats: int) -> dict:
    import torch

    from qkv.nn.kernels import kernel_for

    torch.set_num_threads(1)
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, HEADS, n, HEAD_DIM) for _ in range(3))
    kernel = kernel_for(name, window=WINDOW)
    call = lambda: kernel(q, k, v, mask=None, causal=True, bias=None, scale=HEAD_DIM ** -0.5)  # noqa: E731
    with torch.no_grad():
        small = torch.randn(1, HEADS, 64, HEAD_DIM)
        kernel(small, small, small, mask=None, causal=True, bias=None, scale=1.0)  # load code, warm caches
        before = resident_bytes()
        start = time.perf_counter()
        out = call()
        first = time.perf_counter() - start
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        del out
        times = [first] if first > 5 else []
        while len(times) < repeats and not (times and sum(times) > 20):
            start = time.perf_counter()
            call()
            times.append(time.perf_counter() - start)
    return {"peak_mib": max(peak - before, 0) / 2**20, "seconds": statistics.median(times)}


def training(name: str, n: int, repeats: int) -> dict:
    """Saved-for-backward bytes and forward + backward seconds of one causal call, one thread."""
    import torch

    from qkv.analysis.measure import saved_for_backward_bytes
    from qkv.nn.kernels import kernel_for

    torch.set_num_threads(1)
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, HEADS, n, HEAD_DIM, requires_grad=True) for _ in range(3))
    kernel = kernel_for(name, window=WINDOW)

    def step():
        out = kernel(q, k, v, mask=None, causal=True, bias=None, scale=HEAD_DIM ** -0.5)
        out.backward(torch.ones_like(out))

    saved = saved_for_backward_bytes(lambda: kernel(q, k, v, mask=None, causal=True, bias=None,
                                                    scale=HEAD_DIM ** -0.5))
    step()  # warm-up
    times = []
    while len(times) < repeats and not (times and sum(times) > 20):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return {"saved_mib": saved / 2**20, "seconds": statistics.median(times)}


def table(title: str, names: list[str], sizes: list[int], run, mib: str, quadratic: tuple[str, ...],
          max_gib: float) -> None:
    """One markdown row per kernel: MiB (`mib` of each `run(name, n)` result) and seconds at each n, and the
    growth between the last two sizes. Kernels in `quadratic` are skipped past `max_gib` of n x n arrays."""
    print(title)
    print("| kernel | " + " | ".join(f"n={n} MiB | n={n} s" for n in sizes) + " | MiB x | s x |")
    print("|" + "---|" * (2 * len(sizes) + 3))
    for name in names:
        cells, rows = [], []
        for n in sizes:
            if name in quadratic and quadratic_gib(n) > max_gib:
                cells += [f"skipped (~{quadratic_gib(n) * 1024:.0f})", "-"]
                continue
            row = run(name, n)
            rows.append(row)
            cells += [f"{row[mib]:.1f}", f"{row['seconds']:.3f}"]
        growth = ("-", "-")
        if len(rows) >= 2:
            growth = (f"{rows[-1][mib] / max(rows[-2][mib], 1e-9):.2f}", f"{rows[-1]['seconds'] / rows[-2]['seconds']:.1f}")
        print(f"| {name} | " + " | ".join(cells) + f" | {growth[0]} | {growth[1]} |", flush=True)


def measure(name: str, n: int, repeats: int) -> dict:
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536")
    result = subprocess.run([sys.executable, __file__, "--worker", name, str(n), str(repeats)], env=env,
                            capture_output=True, text=True, check=True)
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[512, 2048, 8192])
    parser.add_argument("--kernels", nargs="+", default=None)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-gib", type=float, default=2.0)
    parser.add_argument("--backward", action="store_true", help="training: saved bytes, forward + backward time")
    parser.add_argument("--worker", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        name, n, repeats = args.worker
        print(json.dumps(worker(name, int(n), int(repeats))))
        return
    from qkv.nn.kernels import KERNELS

    names = args.kernels or KERNELS.names()
    if args.backward:
        sizes = args.sizes if args.sizes != [512, 2048, 8192] else [512, 1024, 2048, 4096]
        table(f"causal attention forward + backward, B=1 H={HEADS} Dh={HEAD_DIM} fp32, window={WINDOW}, 1 thread; "
              "MiB saved for the backward and seconds; x = growth per doubling of n (2 linear, 4 quadratic)",
              names, sizes, lambda name, n: training(name, n, args.repeats), "saved_mib", ("naive", "sdpa"),
              args.max_gib)
        return
    table(f"causal attention forward, B=1 H={HEADS} Dh={HEAD_DIM} fp32, window={WINDOW}, 1 thread; peak extra MiB "
          "(RSS) and seconds; x = growth per 4x n (16 quadratic, 4 linear)", names, args.sizes,
          lambda name, n: measure(name, n, args.repeats), "peak_mib", ("naive",), args.max_gib)


if __name__ == "__main__":
    main()
