"""One row's matrix products in a compiled decoding step: torch's kernels against the summed form.

    python benchmarks/one_row_products.py [--repeats 20] [--threads 2] [--rows 1] [--json out.json]

A batch-1 decoding step of SmolLM2-135M multiplies one row by each layer's fused Q/K/V (960 x 576), W^O (576 x
576), fused gate/up (3,072 x 576) and down (576 x 1,536) matrices, 30 layers, 106 M weights, and by the
49,152 x 576 head. Each precision's products are timed two ways, each compiled as one graph the way
qkv.generate.compiled compiles the step (torch.compile, cpp_wrapper, fp32 rows in, the head apart):

    kernels   torch's products: W x^T (fp32, qkv.nn.decoding_linear.left_product), F.linear (bf16),
              torch._weight_int8pack_mm (int8, the rows in bf16 where the CPU has native bf16, as
              QuantLinear multiplies)
    summed    qkv.nn.decoding_linear.summed_product: sum_j W_ij x_j written as a broadcast product and a sum,
              which inductor generates as one loop per output row

At int8 two more ways multiply int8 by int8 (the row itself rounded to 8 bits with one scale, as llama.cpp's
Q8_0 does with VNNI; not qkv's product, whose row stays bf16 or fp32, so only their speed is compared):

    int_mm    torch._int_mm (int8 x int8 -> int32), the weights as W^T's view
    onednn    oneDNN's quantized linear (torch.ops.onednn.qlinear_pointwise; the row as uint8 with a zero
              point, the weights prepacked)

`--rows R` > 1: a short prompt's R rows instead of one (the compiled prefill, CompiledStep.prompt): the summed
form then reads each W_ij once for all R rows (a loop per output row over the rows); no int8 x int8 ways, no
head (a prompt's head takes its last row only).

The ways alternate; medians of --repeats. The rate is the bytes of weights read a step over the time.
The weights are random: a product's time does not depend on the values.
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch
import torch.nn.functional as F

from qkv import hardware
from qkv.nn.decoding_linear import left_product, summed_product, summing
from qkv.nn.quant import QuantLinear

LAYERS, D, FF, QKV, VOCAB = 30, 576, 1536, 960, 49152
SHAPES = [(QKV, D), (D, D), (2 * FF, D), (D, FF)]  # (out, in) of one layer's products


def layers_of(precision: str) -> list:
    """SmolLM2-shaped layers at `precision`: plain weights (fp32, bf16) or QuantLinear (int8, int4)."""
    torch.manual_seed(0)
    made = []
    for _ in range(LAYERS):
        for out, inp in SHAPES:
            w = torch.randn(out, inp) * 0.02
            if precision in ("int8", "int4"):
                linear = torch.nn.Linear(inp, out, bias=False)
                linear.weight.data = w
                made.append(QuantLinear.from_linear(linear, precision))
            else:
                made.append(w.to(torch.float32 if precision == "fp32" else torch.bfloat16))
    return made


def kernels(x: torch.Tensor, layers: list, precision: str) -> list[torch.Tensor]:
    outs = []
    for layer in layers:
        row = w_row(x, layer)
        if precision == "fp32":
            outs.append(left_product(row, layer, None))
        elif precision == "bf16":
            outs.append(F.linear(row.bfloat16(), layer).float())
        else:
            outs.append(layer(row))  # QuantLinear: torch's weight-only kernel
    return outs


def int_mm(x: torch.Tensor, layers: list, precision: str) -> list[torch.Tensor]:
    outs = []
    for layer in layers:
        row = w_row(x, layer)
        step = row.abs().amax().clamp(min=1e-8) / 127.0
        q = torch.round(row / step).to(torch.int8)
        outs.append(torch._int_mm(q, layer.codes.t()).float() * (step * layer.scale))
    return outs


def onednn_way(layers: list):
    """oneDNN's u8 x s8 linear for each layer, its weights prepacked once (outside the timed calls); None where
    this build of torch has no oneDNN quantized linear (not x86)."""
    try:
        packed = [(torch.ops.onednn.qlinear_prepack(layer.codes, [1, layer.in_features]), layer.scale,
                   torch.zeros(layer.out_features, dtype=torch.int64)) for layer in layers]
    except (AttributeError, RuntimeError) as error:
        print(f"onednn: skipped ({type(error).__name__}: {str(error).splitlines()[0][:120]})")
        return None

    def onednn(x: torch.Tensor) -> list[torch.Tensor]:
        rows = {}  # the row of each width rounded once (a step's rows differ by layer; their rounding fuses into
        for layer in layers:  # the step's other kernels, so the time here is the products')
            if layer.in_features not in rows:
                row = w_row(x, layer)
                low, high = row.amin().clamp(max=0), row.amax().clamp(min=0)
                step = ((high - low) / 255.0).clamp(min=1e-8)
                point = torch.round(-low / step)
                rows[layer.in_features] = ((torch.round(row / step) + point).clamp(0, 255).to(torch.uint8),
                                           float(step), int(point))
        outs = []
        for layer, (weights, scale, zero) in zip(layers, packed):
            q, step, point = rows[layer.in_features]
            outs.append(torch.ops.onednn.qlinear_pointwise(q, step, point, weights, scale, zero, None,
                                                           1.0, 0, torch.float32, "none", [], ""))
        return outs
    return onednn


def summed(x: torch.Tensor, layers: list, precision: str) -> list[torch.Tensor]:
    """summed_product for plain weights; QuantLinear's int8 product takes that form itself (traced inside
    summing(True), as the compiled step is)."""
    if x.shape[0] > 1 and precision == "int8":  # (QuantLinear itself takes torch's kernel for several rows)
        rows = torch.bfloat16 if hardware.native_bf16_cpu() else torch.float32
        return [summed_product(w_row(x, w).to(rows), w.codes, scale=w.scale).float() for w in layers]
    return [summed_product(w_row(x, w).to(w.dtype), w).float() if isinstance(w, torch.Tensor) else w(w_row(x, w))
            for w in layers]


def w_row(x: torch.Tensor, layer) -> torch.Tensor:
    return x[:, :layer.shape[1] if isinstance(layer, torch.Tensor) else layer.in_features]


def head(x: torch.Tensor, w: torch.Tensor, way: str) -> torch.Tensor:
    row = x[:, :D].to(w.dtype)
    if way == "summed":
        return summed_product(row, w)
    return left_product(row, w, None) if w.dtype == torch.float32 else F.linear(row, w)


def summing_call(fn, on: bool):
    """fn called inside summing(on), as the compiled step calls its graph (qkv.generate.compiled)."""
    def call(x):
        with summing(on):
            return fn(x)
    return call


def weight_bytes(layers: list) -> int:
    total = 0
    for layer in layers:
        tensors = [layer] if isinstance(layer, torch.Tensor) else [layer.codes, layer.scale] + (
            [layer.low] if layer.low is not None else [])
        total += sum(t.numel() * t.element_size() for t in tensors)
    return total


def timed(fn, x, repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn(x)
        times.append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--precisions", nargs="+", default=["fp32", "bf16", "int8"], choices=["fp32", "bf16", "int8"])
    parser.add_argument("--rows", type=int, default=1, help="rows multiplied at once (a short prompt's: > 1)")
    parser.add_argument("--json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    options = {"cpp_wrapper": True, "emulate_precision_casts": True}
    x = torch.randn(args.rows, FF)
    results = {}
    print(f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {platform.machine()}, "
          f"{hardware.cpu_model()}, native bf16: {hardware.native_bf16_cpu()}, {args.threads} threads, {args.rows} "
          f"row(s), "
          f"torch {torch.__version__}")
    with torch.inference_mode():
        for precision in args.precisions:
            layers = layers_of(precision)
            ways = {way: summing_call(torch.compile(lambda x, f=f: f(x, layers, precision), options=options),
                                      way == "summed") for way, f in (("kernels", kernels), ("summed", summed))}
            if precision == "int8" and args.rows == 1:
                ways["int_mm"] = torch.compile(lambda x: int_mm(x, layers, precision), options=options)
                onednn = onednn_way(layers)  # eager: its scalar arguments are the row's, each call
                if onednn is not None:
                    ways["onednn"] = onednn
            want = ways["kernels"](x)
            for way, fn in ways.items():  # the same products (int8: the rows' rounding; int8 x int8: the row's)
                for got, ref in zip(fn(x), want):
                    torch.testing.assert_close(got.float(), ref.float(), rtol=0.05, atol=0.05)
            times = {way: [] for way in ways}
            for _ in range(3):  # alternating rounds
                for way, fn in ways.items():
                    times[way] += timed(fn, x, args.repeats)
            nbytes = weight_bytes(layers)
            row = {}
            for way in ways:
                ms = statistics.median(times[way]) * 1e3
                row[way] = {"ms": ms, "GB/s": nbytes / ms / 1e6}
            results[precision] = row
            print(f"body {precision:5s} {nbytes / 2 ** 20:6.0f} MiB: " + ", ".join(
                f"{way} {row[way]['ms']:6.2f} ms ({row[way]['GB/s']:4.1f} GB/s)" for way in ways), flush=True)
        for dtype in (torch.float32, torch.bfloat16) if args.rows == 1 else ():
            w = (torch.randn(VOCAB, D) * 0.02).to(dtype)
            ways = {way: summing_call(torch.compile(lambda x, way=way: head(x, w, way), options=options),
                                      way == "summed") for way in ("kernels", "summed")}
            times = {way: [] for way in ways}
            for _ in range(3):
                for way, fn in ways.items():
                    fn(x)
                    times[way] += timed(fn, x, args.repeats)
            name = f"head {str(dtype).removeprefix('torch.')}"
            results[name] = {way: {"ms": statistics.median(t) * 1e3} for way, t in times.items()}
            print(f"{name} (49,152 x 576): kernels {results[name]['kernels']['ms']:.2f} ms, summed "
                  f"{results[name]['summed']['ms']:.2f} ms", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
