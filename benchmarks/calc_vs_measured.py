"""The calculators (qkv.analysis) against measurement on built models, CPU.

For each configuration: parameters (formula vs `sum(p.numel())`), forward+backward FLOPs of one step
(formula vs torch.utils.flop_counter; the naive kernel, whose Q K^T and A V the counter sees) and the
peak tensor memory of one AdamW training step (estimate vs qkv.analysis.measure.LiveBytes), with and
without activation checkpointing; ratios are calculator / measured (1.00 = exact).

    PYTHONPATH=src python benchmarks/calc_vs_measured.py [--batch 4] [--seq 128] [--threads 1]
"""
from __future__ import annotations

import argparse
import time

import torch
from torch.utils.checkpoint import checkpoint

import qkv
from qkv.analysis import flops, memory, params
from qkv.analysis.measure import count_flops, peak_step_bytes
from qkv.config import ModelConfig
from qkv.train.objectives import lm_loss

BASE = dict(vocab_size=2048, d_model=128, n_heads=4, n_layers=4, d_ff=512, max_seq_len=256, attention="naive")
CONFIGS = {
    "gpt (pre-LN, GELU, tied)": {},
    "post-LN, untied": {"norm_placement": "post", "tie_embeddings": False},
    "llama (RoPE, RMSNorm, SwiGLU, GQA)": {"positional": "rope", "norm": "rmsnorm", "ffn": "glu",
                                          "activation": "silu", "n_kv_heads": 2, "bias": False},
    "MoE 4 experts, top 2": {"moe_experts": 4, "moe_top_k": 2},
    "sdpa kernel": {"attention": "sdpa"},
}


def step_fn(model, ids, optimizer):
    def step():
        lm_loss(model, (ids[:, :-1], ids[:, 1:]), 0.0).backward()  # as qkv.train.loop: the chunked head-and-loss
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return step


def measure(cfg: ModelConfig, batch: int, seq: int, checkpointing: bool) -> dict:
    torch.manual_seed(0)
    model = qkv.build_model(cfg)
    if checkpointing:
        for block in model.blocks:
            block.forward = (lambda f: lambda *a, **k: checkpoint(f, *a, use_reentrant=False, **k))(block.forward)
    ids = torch.randint(0, cfg.vocab_size, (batch, seq + 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    counted, _ = count_flops(lambda: model(ids[:, :-1]).float().sum().backward())
    model.zero_grad(set_to_none=True)
    peak = peak_step_bytes(model, optimizer, step_fn(model, ids, optimizer))["peak"]
    return {"params": sum(p.numel() for p in model.parameters()), "flops": counted, "peak": peak}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"calculator / measured, batch {args.batch} x {args.seq} tokens, fp32, AdamW, CPU\n")
    header = f"{'configuration':<36} {'ckpt':>4} {'params':>12} {'ratio':>6} {'GFLOP':>8} {'ratio':>6} " \
             f"{'peak MB':>8} {'est MB':>8} {'ratio':>6} {'s':>5}"
    print(header)
    print("-" * len(header))
    for name, variant in CONFIGS.items():
        cfg = ModelConfig(**{**BASE, **variant})
        for ckpt in (False, True):
            start = time.perf_counter()
            m = measure(cfg, args.batch, args.seq, ckpt)
            n = params.count(cfg)
            f = 3 * sum(flops.forward(cfg, batch=args.batch, seq=args.seq).values())
            f += flops.recomputed(cfg, batch=args.batch, seq=args.seq) if ckpt else 0
            est = memory.training(cfg, memory.Setup(batch=args.batch, seq=args.seq, checkpointing=ckpt))["total"]
            print(f"{name:<36} {'yes' if ckpt else 'no':>4} {m['params']:>12,} {n / m['params']:>6.2f} "
                  f"{m['flops'] / 1e9:>8.3f} {f / m['flops']:>6.2f} {m['peak'] / 1e6:>8.1f} {est / 1e6:>8.1f} "
                  f"{est / m['peak']:>6.2f} {time.perf_counter() - start:>5.1f}")
    print("\nFLOPs with checkpointing include the recomputed layer forwards (hardware FLOPs). The sdpa rows' "
          "counter misses the fused CPU attention kernel (no FLOP formula registered for it), so their ratio "
          "exceeds 1 by the attention-score share.")


if __name__ == "__main__":
    main()
