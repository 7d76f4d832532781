"""int4's products of a few rows: qkv/nn/grouped.c's loops with fp32 rows (qkv.nn.grouped.native_int4_product,
what qkv takes where measured faster: qkv.nn.forms' native_int4) against torch's int4 kernel with bf16 rows (what
it took before, and takes for longer prompts), on SmolLM2's and Gemma 3's int4 shapes.

    python benchmarks/int4_rows.py [--rows 1 4 8] [--threads 2] [--rounds 15]

"hot": one layer called again and again (in the caches); "cold": as many copies of it as make 64 MB, called in
turn (from memory, as a decode step reads its layers). Engines alternate within each round; medians in us a call.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from qkv.nn.grouped import native_int4_kernel, native_int4_product
from qkv.nn.quant import QuantLinear

SHAPES = [("SmolLM2 q/k/v fused", 960, 576), ("SmolLM2 gate/up fused", 3072, 576), ("SmolLM2 down", 576, 1536),
          ("Gemma 3 o (Q4_K)", 640, 1024), ("Gemma 3 down (Q4_K)", 640, 2048)]


def layers(n: int, k: int, copies: int) -> list[QuantLinear]:
    out = []
    for _ in range(copies):
        layer = QuantLinear.from_linear(torch.nn.Linear(k, n, bias=False), "int4")
        layer.kernel_operands(torch.bfloat16)  # (torch's packed copy made before the timing)
        out.append(layer)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if native_int4_kernel() is None:
        raise SystemExit("grouped.c does not build here (no C compiler, or QKV_NATIVE=0)")
    print(f"{'shape':<24} {'rows':>4} {'where':>5} {'loops, fp32 row':>16} {'torch int4, bf16':>17}")
    for name, n, k in SHAPES:
        copies = max(1, round(64 * 2 ** 20 / (n * k * 3 // 4)))
        for rows in args.rows:
            for where, held in (("hot", layers(n, k, 1) * copies), ("cold", layers(n, k, copies))):
                x = torch.randn(rows, k)
                xb = x.bfloat16()
                forms = {"loops": lambda: [native_int4_product(x, m.codes, m.scale, m.low) for m in held],
                         "torch": lambda: [torch._weight_int4pack_mm_for_cpu(xb, *m.kernel_operands(torch.bfloat16)[:1],
                                                                             32, m.kernel_operands(torch.bfloat16)[1])
                                           for m in held]}
                times = {form: [] for form in forms}
                for _ in range(args.rounds + 1):
                    for form, run in forms.items():
                        start = time.perf_counter()
                        run()
                        times[form].append((time.perf_counter() - start) / len(held) * 1e6)
                medians = {form: statistics.median(values[1:]) for form, values in times.items()}
                print(f"{name:<24} {rows:>4} {where:>5} {medians['loops']:>16.1f} {medians['torch']:>17.1f}", flush=True)


if __name__ == "__main__":
    main()
