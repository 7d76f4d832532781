"""One GPU, one command (a few minutes on an H100/H200): GPT-2 124M bf16 training speed and MFU, decoding
bandwidth utilisation, and the flash kernels checked against the naive one.

    python benchmarks/gpu.py [--batch 16] [--steps 10] [--no-compile] [--json out.json]

- machine: the bf16 matmul rate (8192^3 GEMMs, 2 n^3 FLOPs, best of several) and the copy bandwidth (a
  1 GiB tensor copied, bytes read + written per second), measured on this card: MFU is taken against the
  measured rate (and, for reference, the data-sheet peak of qkv.analysis.flops.PEAK_FLOPS).
- flash check: qkv's `sdpa` kernel (torch's fused kernels; flash forced where the card has it) and `flash`
  (the tiled online-softmax kernel) against `naive`, bf16, causal, B=4 H=12 T=1024 Dh=64: max |difference|
  of the outputs and of dQ, dK, dV, with the naive kernel's own bf16-vs-fp32 error as the yardstick.
- train: the `gpt2-124m` preset, batches of --batch x 1024, the product path (fp32 master weights, bf16
  autocast, qkv's LM loss, qkv's fused AdamW, clipping at 1.0), model.compile() unless --no-compile;
  tokens/s over --steps steps after 3 warm-up steps; MFU = tokens/s x train FLOPs per token / matmul rate.
- decode: bf16 weights, greedy, batch 1, 16 prompt + 256 new tokens; bandwidth utilisation = tokens/s x
  bytes of weights read per token / copy bandwidth (one step must read every weight once).

Without a CUDA device it says so and exits with status 2.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

import qkv
from qkv.analysis import flops
from qkv.config import TrainConfig
from qkv.nn.kernels import KERNELS
from qkv.train.objectives import lm_loss
from qkv.train.optim import OPTIMIZERS

SEQ = 1024


def cuda_seconds(fn, repeats: int) -> float:
    """The fastest of `repeats` calls, timed with CUDA events."""
    best = float("inf")
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3)
    return best


def machine() -> dict:
    n = 8192
    a, b = (torch.randn(n, n, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    torch.mm(a, b)
    matmul = 2 * n ** 3 / cuda_seconds(lambda: torch.mm(a, b), 10)
    src = torch.ones(2 ** 28, device="cuda")  # 1 GiB
    dst = torch.empty_like(src)
    dst.copy_(src)
    copy = 2 * src.numel() * 4 / cuda_seconds(lambda: dst.copy_(src), 10)
    return {"device": torch.cuda.get_device_name(), "bf16_matmul_flops_per_s": matmul, "copy_bytes_per_s": copy,
            "datasheet_peak": flops.peak_flops_for(torch.cuda.get_device_name())}


def flash_check() -> dict:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    torch.manual_seed(0)
    shape = (4, 12, 1024, 64)
    q, k, v = (torch.randn(shape, device="cuda") for _ in range(3))
    dout = torch.randn(shape, device="cuda")

    def run(name: str, dtype) -> list[torch.Tensor]:
        inputs = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
        out = KERNELS.get(name).fn(*inputs, mask=None, causal=True, bias=None, scale=shape[-1] ** -0.5)
        out.backward(dout.to(dtype))
        return [out.detach().float()] + [t.grad.float() for t in inputs]

    reference = run("naive", torch.float32)
    gap = lambda got: max(float((a - b).abs().max()) for a, b in zip(got, reference))  # noqa: E731
    from qkv.nn import flash

    before = dict(flash.BACKENDS_RUN)
    result = {"naive_bf16": gap(run("naive", torch.bfloat16)), "flash_bf16": gap(run("flash", torch.bfloat16)),
              "flash_fp32": gap(run("flash", torch.float32))}
    result["flash_backends"] = {name: n - before.get(name, 0) for name, n in flash.BACKENDS_RUN.items()
                                if n != before.get(name, 0)}  # which kernels qkv's flash dispatched to
    masked = [t.detach().to(torch.bfloat16).requires_grad_() for t in (q, k, v)]  # a bias keeps it tiled
    bias = torch.zeros(1, shape[1], shape[2], shape[2], device="cuda")
    KERNELS.get("flash").fn(*masked, mask=None, causal=True, bias=bias, scale=shape[-1] ** -0.5)
    result["flash_with_bias_backend"] = "tiled" if flash.BACKENDS_RUN["tiled"] > before.get("tiled", 0) else "fused"
    try:
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            result["sdpa_flash_bf16"] = gap(run("sdpa", torch.bfloat16))
    except RuntimeError as exc:  # no flash kernel for this card
        result["sdpa_flash_bf16"] = f"unavailable: {str(exc).splitlines()[0]}"
    result["sdpa_bf16"] = gap(run("sdpa", torch.bfloat16))
    return result


def train(batch: int, steps: int, compile_model: bool, matmul: float) -> dict:
    cfg = qkv.presets.get("gpt2-124m").model
    torch.manual_seed(0)
    model = qkv.build_model(cfg).cuda().train()
    optimizer = OPTIMIZERS.get("adamw")(model, TrainConfig(lr=6e-4))
    if compile_model:
        model.compile()
    tokens = torch.randint(0, cfg.vocab_size, (batch, SEQ + 1), device="cuda")
    inputs, targets = tokens[:, :-1], tokens[:, 1:]

    def step() -> None:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = lm_loss(model, (inputs, targets), 0.0)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    start = time.perf_counter()
    for _ in range(3):  # warm-up (and compilation)
        step()
    torch.cuda.synchronize()
    warmup_s = time.perf_counter() - start
    torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    rate = steps * batch * SEQ / (time.perf_counter() - start)
    per_token = flops.train_flops_per_token(cfg, SEQ)
    return {"batch": [batch, SEQ], "compiled": compile_model, "warmup_s": warmup_s, "tokens_per_s": rate,
            "flops_per_s": rate * per_token, "mfu": rate * per_token / matmul,
            "peak_memory_gib": torch.cuda.max_memory_allocated() / 2 ** 30}


def decode(copy_bandwidth: float) -> dict:
    cfg = qkv.presets.get("gpt2-124m").model
    torch.manual_seed(0)
    model = qkv.build_model(cfg).cuda().to(torch.bfloat16).eval()
    ids = torch.randint(0, cfg.vocab_size, (1, 16), device="cuda")
    new = 256
    qkv.generate(model, ids, max_new_tokens=8)
    torch.cuda.synchronize()
    start = time.perf_counter()
    qkv.generate(model, ids, max_new_tokens=new)
    torch.cuda.synchronize()
    rate = new / (time.perf_counter() - start)
    unique = {p.data_ptr(): p for p in model.parameters()}.values()
    weight_bytes = sum(p.numel() * p.element_size() for p in unique) - model.positional.weight.nbytes
    return {"tokens_per_s": rate, "weight_bytes": weight_bytes,
            "bandwidth_utilisation": rate * weight_bytes / copy_bandwidth}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--no-compile", action="store_true")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if args.json is not None and args.json.exists():
        parser.error(f"{args.json} exists; not overwriting it")
    if not torch.cuda.is_available():
        print("gpu.py: error: no CUDA device (torch.cuda.is_available() is False); this benchmark needs a GPU. "
              "On CPU run benchmarks/run.py", file=sys.stderr)
        sys.exit(2)
    results = {"torch": torch.__version__, "machine": machine()}
    m = results["machine"]
    print(f"{m['device']}: bf16 matmul {m['bf16_matmul_flops_per_s'] / 1e12:.0f} TFLOP/s measured "
          f"(data sheet {m['datasheet_peak'] or 0:.3g}), copy {m['copy_bytes_per_s'] / 1e9:.0f} GB/s", flush=True)
    results["flash_check"] = flash_check()
    print("flash check, max |x - naive fp32| over out, dQ, dK, dV:",
          ", ".join(f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}" for k, v in results["flash_check"].items()),
          flush=True)
    t = results["train"] = train(args.batch, args.steps, not args.no_compile, m["bf16_matmul_flops_per_s"])
    print(f"GPT-2 124M bf16 training, batch {args.batch} x {SEQ}{' compiled' if t['compiled'] else ''}: "
          f"{t['tokens_per_s']:,.0f} tokens/s, {t['flops_per_s'] / 1e12:.0f} TFLOP/s, MFU {100 * t['mfu']:.0f}% "
          f"of the measured matmul rate (goal >= 50%), peak {t['peak_memory_gib']:.1f} GiB, "
          f"warm-up {t['warmup_s']:.0f} s", flush=True)
    d = results["decode"] = decode(m["copy_bytes_per_s"])
    print(f"GPT-2 124M bf16 greedy decoding, batch 1: {d['tokens_per_s']:.0f} tokens/s, "
          f"{100 * d['bandwidth_utilisation']:.0f}% of the copy bandwidth")
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
