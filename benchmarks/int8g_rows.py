"""int8g's products for a decode step's few bf16 rows (qkv.nn.grouped.grouped_product): each group's product by
torch's int8 kernel, weighed by its fp32 scales, accumulated group by group or stacked, against dequantizing W
to bf16 for the product (what a long prompt's rows take), a bf16 W of the same shape, torch's int8 kernel with
one scale a row (--quant int8's layout, for the bandwidth it reaches), the loops of qkv/nn/grouped.c with the
row in fp32 where they build (the form qkv takes where measured faster: qkv.nn.forms), and, for groups of 32,
the same product as two int4 ones (a code c = 16 h + l in -128..127 splits exactly: l in 0..15 with scale s and
minimum m, h + 8 in 0..15 with scale 16 s and minimum -128 s; not a form qkv takes, measured for what it would
give).

    python benchmarks/int8g_rows.py [--rows 1] [--threads 2] [--rounds 15]

Shapes: SmolLM2-135M's and Gemma 3 270M's tied heads (Q8_0 in both files), Gemma 3's gate/up (Q5_0, groups of
32) and down (Q6_K, groups of 16) projections. Engines alternate within each round; medians in ms.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from qkv.nn.grouped import dequantize_grouped, native_kernel, native_product
from qkv.nn.quant import QuantLinear

SHAPES = [("SmolLM2 head, Q8_0", 49152, 576, 32), ("Gemma 3 head, Q8_0", 262144, 640, 32),
          ("Gemma 3 gate/up, Q5_0", 2048, 640, 32), ("Gemma 3 down, Q6_K", 640, 2048, 16)]


def forms(n: int, k: int, g: int, rows: int) -> dict:
    groups = k // g
    codes = torch.randint(-32, 32, (groups, n, g), dtype=torch.int8)  # (G, N, g), as int8g holds them
    plain = codes.transpose(0, 1).reshape(n, k).contiguous()
    scale_t = torch.rand(groups, n) / 100
    scale = scale_t.t().contiguous()
    ones = torch.ones(n, dtype=torch.bfloat16)
    x = torch.randn(rows, k, dtype=torch.bfloat16)
    w16 = dequantize_grouped(plain, scale, None, torch.bfloat16)

    def accumulated():
        xs = x.view(rows, groups, g).transpose(0, 1).contiguous()
        y = torch.zeros(rows, n)
        for i in range(groups):
            y.addcmul_(torch._weight_int8pack_mm(xs[i], codes[i], ones), scale_t[i])
        return y

    def stacked():
        xs = x.view(rows, groups, g).transpose(0, 1).contiguous()
        parts = torch.stack([torch._weight_int8pack_mm(xs[i], codes[i], ones) for i in range(groups)])
        return (parts.float() * scale_t[:, None]).sum(0)

    ways = {}
    if g == 32:  # the int4 kernel's groups
        low = plain & 15  # l = c mod 16, h = (c - l) / 16 in -8..7
        halves = [QuantLinear.from_codes(low.to(torch.uint8), scale, torch.zeros_like(scale), None, kind="int4"),
                  QuantLinear.from_codes(((plain - low) // 16 + 8).to(torch.uint8), 16 * scale, -128 * scale, None,
                                         kind="int4")]
        for half in halves:
            half.compute_dtype = torch.bfloat16
        torch.testing.assert_close(halves[0](x.float()) + halves[1](x.float()),
                                   torch.nn.functional.linear(x.float(), dequantize_grouped(plain, scale, None)),
                                   rtol=2e-2, atol=2e-2 * float(scale.max()) * k)  # the same product
        ways["two int4 products"] = lambda: halves[0](x) + halves[1](x)
    if native_kernel() is not None:  # grouped.c's loops (qkv.nn.grouped.native_product), the row in fp32
        xf = x.float()
        ways["grouped.c, fp32 row"] = lambda: native_product(xf, codes, scale_t, None)
    return {**ways, "grouped, accumulated": accumulated, "grouped, stacked": stacked,
            "dequantized to bf16": lambda: torch.nn.functional.linear(x, dequantize_grouped(plain, scale, None,
                                                                                           torch.bfloat16)),
            "bf16 W": lambda: torch.nn.functional.linear(x, w16),
            "int8, a scale a row": lambda: torch._weight_int8pack_mm(x, plain, ones)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), f"{args.threads} threads, {args.rows} row(s), ms")
    for label, n, k, g in SHAPES:
        engines = forms(n, k, g, args.rows)
        times = {name: [] for name in engines}
        for fn in engines.values():
            fn()
        for _ in range(args.rounds):
            for name, fn in engines.items():
                start = time.perf_counter()
                fn()
                times[name].append((time.perf_counter() - start) * 1e3)
        print(f"{label} ({n} x {k}, groups of {g}): " +
              ", ".join(f"{name} {statistics.median(t):.2f}" for name, t in times.items()))


if __name__ == "__main__":
    main()
