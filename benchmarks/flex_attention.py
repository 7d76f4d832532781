"""torch's FlexAttention (torch.compile'd flex_attention with a block mask) against qkv's own sparse kernels
(`local`: banded tiles; `dilated`: residue classes) on this CPU: forward, and forward + backward, causal,
B = 1, H = 4, Dh = 64, fp32, one thread, window / dilation 256; the median of --repeats calls after a warm-up
call, and FlexAttention's one-time compile (first call) for each shape, which a new sequence length pays
again. Outputs are checked equal (max |difference| printed).

    PYTHONPATH=src python benchmarks/flex_attention.py [--sizes 512 2048 8192] [--repeats 3]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

from qkv.nn.kernels import kernel_for

HEADS, HEAD_DIM, WINDOW = 4, 64, 256
MASKS = {  # FlexAttention's mask_mod for each qkv kernel (qkv.nn.sparse's patterns, causal)
    "local": lambda b, h, i, j: (i >= j) & (i - j <= WINDOW),
    "dilated": lambda b, h, i, j: (i >= j) & ((i - j) % WINDOW == 0),
}


def timed(fn, repeats: int) -> tuple[float, float]:
    """(first call, median of the next `repeats`) in seconds."""
    start = time.perf_counter()
    fn()
    first = time.perf_counter() - start
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return first, statistics.median(times)


def measure(name: str, n: int, repeats: int) -> dict:
    torch._dynamo.reset()  # each shape compiles on its own, static: what a run of one sequence length pays
    flex = torch.compile(flex_attention, dynamic=False)
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, HEADS, n, HEAD_DIM, requires_grad=True) for _ in range(3))
    ours = kernel_for(name, window=WINDOW)
    block_mask = create_block_mask(MASKS[name], 1, 1, n, n, device="cpu")

    def run_ours():
        return ours(q, k, v, mask=None, causal=True, bias=None, scale=HEAD_DIM ** -0.5)

    def run_flex(inputs=(q.detach(), k.detach(), v.detach())):  # CPU: inputs that need no grad (see below)
        return flex(*inputs, block_mask=block_mask, scale=HEAD_DIM ** -0.5)

    with torch.no_grad():
        flex_compile, flex_fwd = timed(run_flex, repeats)  # the first call compiles
        _, ours_fwd = timed(run_ours, repeats)
        difference = float((run_ours() - run_flex()).abs().max())
    dout = torch.randn(1, HEADS, n, HEAD_DIM)
    _, ours_train = timed(lambda: torch.autograd.grad(run_ours(), (q, k, v), dout), repeats)
    try:
        flex_train_compile, flex_train = timed(lambda: torch.autograd.grad(run_flex((q, k, v)), (q, k, v), dout),
                                               repeats)
    except NotImplementedError:  # torch 2.13: "FlexAttention does not support backward on CPU"
        flex_train_compile = flex_train = float("nan")
    return {"kernel": name, "n": n, "sparsity_pct": round(float(block_mask.sparsity()), 1), "max_diff": difference,
            "qkv_fwd_s": ours_fwd, "flex_fwd_s": flex_fwd, "flex_compile_s": flex_compile,
            "qkv_train_s": ours_train, "flex_train_s": flex_train, "flex_train_compile_s": flex_train_compile}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[512, 2048, 8192])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--kernels", nargs="+", default=list(MASKS))
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, 1 thread, B=1 H={HEADS} Dh={HEAD_DIM}, window {WINDOW}")
    print(f"{'kernel':>8} {'n':>5} {'skip%':>6} {'qkv fwd':>8} {'flex fwd':>9} {'x':>5} {'qkv f+b':>8} "
          f"{'flex f+b':>9} {'x':>5} {'compile f / f+b':>16} {'max diff':>9}")
    for name in args.kernels:
        for n in args.sizes:
            r = measure(name, n, args.repeats)
            print(f"{name:>8} {n:>5} {r['sparsity_pct']:>6} {r['qkv_fwd_s']:>8.4f} {r['flex_fwd_s']:>9.4f} "
                  f"{r['qkv_fwd_s'] / r['flex_fwd_s']:>5.2f} {r['qkv_train_s']:>8.4f} {r['flex_train_s']:>9.4f} "
                  f"{r['qkv_train_s'] / r['flex_train_s']:>5.2f} {r['flex_compile_s']:>7.1f} / "
                  f"{r['flex_train_compile_s']:>6.1f} {r['max_diff']:>9.2e}", flush=True)


if __name__ == "__main__":
    main()
