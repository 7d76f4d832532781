"""One decoding step's matrix products, taken four ways, on the weights of the benchmark GPT-2.

    python benchmarks/decode_kernels.py [--rows 1 2 4 8 16 32 128] [--repeats 30] [--json out.json]

A decoding step multiplies each of a 6-layer, 384-wide GPT-2's 36 weight matrices (per layer W^Q, W^K,
W^V, W^O, FFN up and down, as qkv holds them) and the 8192 x 384 LM head by a few rows x; 52.6 MiB of
weights, more than the cache holds, so the time is the time to read them. The four ways:

    linear      F.linear(x, W, b), W (out, in) row-major          nn.Linear as it is
    col-major   F.linear(x, W, b), W stored column-major           a transposed copy of every weight
    W x^T       (b + W x^T)^T, W row-major, x^T a transposed view  qkv.generate.decode.DecodingLinear
    W x^T pad   the same, one row widened to two with a zero row   DecodingLinear's one-row case

Each way runs the whole step (all 37 products) in turn, alternating, and reports the median time and
the rate it read the weights at; the machine's read bandwidth (a sum over 256 MiB) is the ceiling.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

D, LAYERS, VOCAB = 384, 6, 8192


def weights() -> list[tuple[torch.Tensor, torch.Tensor]]:
    torch.manual_seed(0)
    shapes = [(D, D)] * 4 + [(4 * D, D), (D, 4 * D)]
    shapes = shapes * LAYERS + [(VOCAB, D)]
    return [(torch.randn(out, inp), torch.randn(out)) for out, inp in shapes]


def w_xt(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.addmm(b[:, None], w, x.t()).t().contiguous()


def w_xt_pad(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    rows = x.shape[0]
    if rows == 1:
        x = torch.cat((x, torch.zeros_like(x)))
    return torch.addmm(b[:, None], w, x.t())[:, :rows].t().contiguous()


def step_times(rows: int, repeats: int, mats, col_major) -> dict[str, float]:
    xs = [torch.randn(rows, w.shape[1]) for w, _ in mats]
    ways = {
        "linear": lambda: [F.linear(x, w, b) for x, (w, b) in zip(xs, mats)],
        "col-major": lambda: [F.linear(x, w, b) for x, (w, b) in zip(xs, col_major)],
        "W x^T": lambda: [w_xt(x, w, b) for x, (w, b) in zip(xs, mats)],
        "W x^T pad": lambda: [w_xt_pad(x, w, b) for x, (w, b) in zip(xs, mats)],
    }
    reference = ways["linear"]()
    for name, way in ways.items():  # the same products, to float rounding
        for got, want in zip(way(), reference):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-3, msg=lambda m: f"{name}: {m}")
    times: dict[str, list[float]] = {name: [] for name in ways}
    for _ in range(repeats):
        for name, way in ways.items():
            start = time.perf_counter()
            way()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def read_bandwidth() -> float:
    big = torch.ones(64 * 2 ** 20)
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        big.sum()
        best = min(best, time.perf_counter() - start)
    return big.numel() * 4 / best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 128])
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    mats = weights()
    col_major = [(w.t().contiguous().t(), b) for w, b in mats]
    nbytes = sum(w.numel() * 4 for w, _ in mats)
    bandwidth = read_bandwidth()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; weights {nbytes / 2 ** 20:.1f} MiB per "
          f"step; read bandwidth {bandwidth / 1e9:.1f} GB/s")
    results = []
    with torch.inference_mode():
        for rows in args.rows:
            times = step_times(rows, args.repeats, mats, col_major)
            results.append({"rows": rows, "ms": {k: v * 1e3 for k, v in times.items()}})
            cells = "  ".join(f"{name} {t * 1e3:6.2f} ms ({nbytes / t / 1e9:4.1f} GB/s)" for name, t in times.items())
            print(f"rows {rows:4d}: {cells}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"torch": torch.__version__, "threads": torch.get_num_threads(), "weight_bytes": nbytes,
                       "read_bandwidth": bandwidth, "steps": results}, f, indent=1)


if __name__ == "__main__":
    main()
