"""An MoE layer's experts, grouped as a runtime groups them (qkv.nn.moe.dispatch: routes sorted by expert once, one
transfer of the counts, each used expert's rows in one product) against asking each of the E experts for its
tokens (the loop qkv had: one nonzero per expert), on a Qwen3-MoE-shaped layer (Qwen3-30B-A3B: D 2,048, 128
experts of F 768, SwiGLU, top 8).

    python benchmarks/moe_dispatch.py [--experts 128] [--top-k 8] [--rounds 20]

Reported: milliseconds a call at a decoding step (1 token) and over a 512-token prompt, both forms alternating in
one run, and the largest difference of their outputs (the same sums in the same order: 0).
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from qkv.nn.moe import MoE


def loop_forward(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """The per-expert loop: each of the E experts asked for its routes (a nonzero and a host sync each)."""
    tokens = x.reshape(-1, x.shape[-1])
    logits = moe.router(tokens).float()
    top_logits, top = logits.topk(moe.top_k, dim=-1)
    gates = top_logits.softmax(-1)
    out = torch.zeros_like(tokens)
    for e, expert in enumerate(moe.experts):
        rows, slot = torch.nonzero(top == e, as_tuple=True)
        if rows.numel():
            out = out.index_add(0, rows, gates[rows, slot, None].to(x.dtype) * expert(tokens[rows]))
    return out.view_as(x)


def timed(fn, rounds: int) -> float:
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--d-model", type=int, default=2048)
    parser.add_argument("--d-ff", type=int, default=768)
    parser.add_argument("--rounds", type=int, default=20)
    args = parser.parse_args()
    torch.manual_seed(0)
    moe = MoE(args.d_model, args.d_ff, experts=args.experts, top_k=args.top_k, ffn="glu", activation="silu",
              bias=False).eval()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; {args.experts} experts of "
          f"{args.d_model} x {args.d_ff} (SwiGLU), top {args.top_k}")
    print("| tokens | per-expert loop ms | grouped ms | speed-up | max difference |")
    print("|---:|---:|---:|---:|---:|")
    for n in (1, 512):
        x = torch.randn(1, n, args.d_model)
        with torch.inference_mode():
            diff = (loop_forward(moe, x) - moe(x)).abs().max().item()
            loop, grouped = [], []
            for _ in range(3):  # alternating
                loop.append(timed(lambda: loop_forward(moe, x), args.rounds if n == 1 else 3))
                grouped.append(timed(lambda: moe(x), args.rounds if n == 1 else 3))
        a, b = statistics.median(loop), statistics.median(grouped)
        print(f"| {n} | {a:.2f} | {b:.2f} | {a / b:.2f}x | {diff:.1e} |")


if __name__ == "__main__":
    main()
