"""An int8 weight-only product at M rows, two ways, on SmolLM2-135M's four matrix shapes.

    python benchmarks/int8_rows.py [--rows 1 2 4 16 32 64 96 128 512] [--repeats 20] [--threads 2]

    kernel   torch._weight_int8pack_mm(x, q, s)             torch's int8 weight-only kernel
    dense    F.linear(x, q.to(x.dtype)) * s                  the codes converted (exact: |q| <= 127), torch's
                                                            dense kernel (oneDNN / MKL), the row scales after

for x in bf16 (what a CPU with native bf16 hands the kernel) and fp32 (what one without it does). The two
alternate; each figure is the median of `repeats`. qkv.nn.quant.int8_dense_rows takes the dense way from the
row count where it wins here.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # fused Q/K/V, W^O, fused gate/up, down


def _ms(fn) -> float:
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 16, 32, 64, 96, 128, 512])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, {args.threads} threads; ms per product, medians of {args.repeats}")
    print(f"{'shape':>11} {'rows':>5} {'dtype':>9} {'kernel':>9} {'dense':>9} {'kernel/dense':>13}")
    for n, k in SHAPES:
        codes = torch.randint(-127, 128, (n, k), dtype=torch.int8)
        scale = torch.rand(n) / 100
        for dtype in (torch.bfloat16, torch.float32):
            s = scale.to(dtype)
            for m in args.rows:
                x = torch.randn(m, k).to(dtype)
                ways = {"kernel": lambda: torch._weight_int8pack_mm(x, codes, s),
                        "dense": lambda: F.linear(x, codes.to(dtype)).mul_(s)}
                times = {name: [] for name in ways}
                for fn in ways.values():  # warm-up
                    fn()
                for _ in range(args.repeats):
                    for name, fn in ways.items():
                        times[name].append(_ms(fn))
                a, b = (statistics.median(times[name]) for name in ways)
                print(f"{n:>5}x{k:<5} {m:>5} {str(dtype)[6:]:>9} {a:>9.3f} {b:>9.3f} {a / b:>13.2f}", flush=True)


if __name__ == "__main__":
    main()
