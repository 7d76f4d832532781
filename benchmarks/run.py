"""qkv against transformers on the same GPT-2 weights: training, decoding, memory, and the machine's limits.

    python benchmarks/run.py [--part train|decode|memory|machine|all] [--json out.json] [--threads N]
        [--repeats 5] [--compile]

One process, one set of weights: a GPT2LMHeadModel (6 layers, 384 wide, 6 heads, 8192-token vocabulary,
256 positions) is built from a config with random weights, saved with save_pretrained and read back through
qkv's Hugging Face import (`qkv.load`), so both sides hold identical weights.

- machine: the fp32 matmul rate (4096 x 4096 GEMMs, FLOPs 2 n^3, best of several, per second and per
  CPU-second) and the copy bandwidth (a 256 MiB tensor copied, bytes read + written per second, best of
  several), at the thread count set.
- train: batches of 8 x 256 tokens, one step = loss, backward, global-norm clipping at 1.0, AdamW, zero_grad.
  qkv runs its product path (qkv.train.objectives' LM loss, qkv.train.optim's AdamW with its defaults);
  transformers runs its own loss (`labels=`) and torch.optim.AdamW as a user of it would. Steps alternate
  A B A B after one warm-up step each; tokens/s is the median; the ratio is of the medians. FLOP/s uses
  qkv.analysis.flops.train_flops_per_token (6N + attention scores, 2 FLOPs per multiply-add), and is
  compared with the measured matmul rate. The same in FLOP per CPU-second (process CPU time, all threads)
  against the matmul's FLOP per CPU-second: on a loaded machine, where waiting for a core inflates every
  wall-clock figure, these and the ratio of CPU seconds are the figures that still mean something.
  --compile adds a third runner in the same alternation: qkv's model under torch.compile (inductor; the
  chunked head-and-loss stays eager), with the seconds of its first step (the compile) reported apart.
- memory: one training step per model in a fresh subprocess: growth of peak RSS (VmHWM) over the RSS
  before it (weights and batch loaded; the peak is reset there through /proc/self/clear_refs), with glibc
  returning every large block at once (a fixed mmap threshold), so the figure tracks live memory:
  gradients, AdamW moments, activations.
- decode: greedy, 16 prompt tokens + 128 new, batch 1 and 8, qkv.generate vs GPT2LMHeadModel.generate
  (benchmarks/generate.py), alternating. The memory-bandwidth floor of one decoding step is the bytes of
  the weights it reads (every matrix once, the tied embedding as the LM head) / the copy bandwidth: a
  step cannot be faster than that; tokens/s at the floor = batch x bandwidth / weight bytes.

Figures taken on a shared machine are noisy; the ratios of alternating runs are the steadier numbers.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import transformers
from transformers import GPT2Config, GPT2LMHeadModel

import qkv
from qkv import hardware
from qkv.analysis import flops
from qkv.parallel.precision import autocast
from qkv.config import TrainConfig
from qkv.train.objectives import lm_loss
from qkv.train.optim import OPTIMIZERS

sys.path.insert(0, str(Path(__file__).parent))
import generate as decode_bench  # noqa: E402  (benchmarks/generate.py)

VOCAB, D, HEADS, LAYERS, CONTEXT = 8192, 384, 6, 6, 256
BATCH, SEQ = 8, 256
MIB = 2 ** 20


# ------------------------------------------------------------------------------------------ the models
def hf_model() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=VOCAB, n_positions=CONTEXT, n_embd=D, n_layer=LAYERS, n_head=HEADS,
                     activation_function="gelu_new", layer_norm_epsilon=1e-5, resid_pdrop=0.0, embd_pdrop=0.0,
                     attn_pdrop=0.0, bos_token_id=None, eos_token_id=None, pad_token_id=0)
    return GPT2LMHeadModel(cfg)


def model_pair() -> tuple[GPT2LMHeadModel, torch.nn.Module, qkv.ModelConfig]:
    """transformers' model and qkv's, the latter read from the former's save_pretrained dir."""
    hf = hf_model()
    with tempfile.TemporaryDirectory() as folder:
        hf.save_pretrained(folder)
        run = qkv.load(folder)
    return hf, run.model, run.config.model


def batch(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(seed))
    return tokens[:, :-1], tokens[:, 1:]  # inputs, targets (B, T)


def training_step(module: torch.nn.Module, optimizer, loss_fn):
    """One step: loss, backward, global-norm clipping at 1.0, optimizer, zero_grad; returns the loss."""
    def run() -> float:
        loss = loss_fn()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(module.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.item()
    return run


def autocast_loss(loss_fn, precision: str):
    """The loss under the training loop's autocast (qkv.parallel.precision): bf16 matmuls, fp32 weights."""
    def run():
        with autocast(torch.device("cpu"), precision):
            return loss_fn()
    return run


def qkv_step(model: torch.nn.Module, precision: str = "fp32"):
    """qkv's product path: the LM objective's loss and qkv.train.optim's AdamW (TrainConfig defaults)."""
    inputs, targets = batch()
    optimizer = OPTIMIZERS.get("adamw")(model, TrainConfig(lr=1e-4, weight_decay=0.1))
    return training_step(model, optimizer, autocast_loss(lambda: lm_loss(model, (inputs, targets), 0.0), precision))


def hf_step(hf: GPT2LMHeadModel, precision: str = "fp32"):
    """transformers as a user runs it: its own loss (`labels=`, shifted inside) and torch.optim.AdamW, under the
    same autocast as qkv's."""
    inputs, targets = batch()
    optimizer = torch.optim.AdamW(hf.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1)
    return training_step(hf, optimizer, autocast_loss(lambda: hf(input_ids=inputs, labels=inputs).loss,  # T - 1
                                                      precision))


def alternate(runners: dict, repeats: int) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Wall-clock and process CPU seconds of each runner, A B A B, after one warm-up call each. On a shared
    machine the CPU seconds are the steadier figure (waiting for a core is not counted)."""
    for fn in runners.values():
        fn()
    wall, cpu = {name: [] for name in runners}, {name: [] for name in runners}
    for _ in range(repeats):
        for name, fn in runners.items():
            start, start_cpu = time.perf_counter(), time.process_time()
            fn()
            wall[name].append(time.perf_counter() - start)
            cpu[name].append(time.process_time() - start_cpu)
    return wall, cpu


# ------------------------------------------------------------------------------------------- the parts
def machine(repeats: int) -> dict:
    n = 4096
    a, b = torch.randn(n, n), torch.randn(n, n)
    out = torch.empty(n, n)
    torch.mm(a, b, out=out)
    best = min(_timed(lambda: torch.mm(a, b, out=out)) for _ in range(repeats))
    best_cpu = min(_timed(lambda: torch.mm(a, b, out=out), time.process_time) for _ in range(repeats))
    src = torch.ones(64 * MIB)  # 256 MiB
    dst = torch.empty_like(src)
    dst.copy_(src)
    copy = min(_timed(lambda: dst.copy_(src)) for _ in range(repeats))
    return {"matmul_flops_per_s": 2 * n ** 3 / best, "matmul_flops_per_cpu_s": 2 * n ** 3 / best_cpu,
            "copy_bytes_per_s": 2 * src.numel() * 4 / copy}


def _timed(fn, clock=time.perf_counter) -> float:
    start = clock()
    fn()
    return clock() - start


def train(repeats: int, hf, model, cfg, machine_rates: dict, compiled: bool = False,
          precision: str = "fp32") -> dict:
    """Tokens/s and FLOP/s by the wall clock, and FLOP per CPU-second against the matmul's FLOP per
    CPU-second: the latter pair does not count time spent waiting for a core on a shared machine. `precision`:
    both sides under the same autocast (bf16: against the fp32 matmul rate all the same)."""
    hf.train()
    model.train()
    runners = {"qkv": qkv_step(model, precision), "transformers": hf_step(hf, precision)}
    compile_seconds = None
    if compiled:  # its first call compiles: timed here, outside the alternation
        runners["qkv compiled"] = qkv_step(torch.compile(model), precision)
        compile_seconds = _timed(runners["qkv compiled"])
    seconds, cpu = alternate(runners, repeats)
    per_token = flops.train_flops_per_token(cfg, SEQ)
    rows = {}
    matmul, matmul_cpu = machine_rates["matmul_flops_per_s"], machine_rates["matmul_flops_per_cpu_s"]
    for name, times in seconds.items():
        rate = BATCH * SEQ / statistics.median(times)
        per_cpu_s = BATCH * SEQ * per_token / statistics.median(cpu[name])
        rows[name] = {"tokens_per_s": rate, "flops_per_s": rate * per_token,
                      "matmul_fraction": rate * per_token / matmul, "flops_per_cpu_s": per_cpu_s, "matmul_cpu_fraction": per_cpu_s / matmul_cpu,
                      "seconds": times, "cpu_seconds": cpu[name]}
    hf.eval()
    model.eval()
    return {"batch": [BATCH, SEQ], "flops_per_token": per_token, "precision": precision, **rows,
            "ratio": rows["qkv"]["tokens_per_s"] / rows["transformers"]["tokens_per_s"],
            "cpu_ratio": statistics.median(cpu["transformers"]) / statistics.median(cpu["qkv"]),
            "compile_seconds": compile_seconds}


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes one decoding step reads: every parameter once (tied ones once), less the position table, of
    which it reads one row."""
    unique = {p.data_ptr(): p for p in model.parameters()}.values()
    skip = model.positional.weight.data_ptr() if hasattr(model.positional, "weight") else None
    return sum(p.numel() * p.element_size() for p in unique if p.data_ptr() != skip)


def decode(repeats: int, hf, model, bandwidth: float | None) -> dict:
    floor = bandwidth / weight_bytes(model) if bandwidth else None  # tokens/s per row at the floor
    rows = []
    for rows_in_batch in (1, 8):
        row = decode_bench.run(rows_in_batch, repeats, hf, model, "cpu")
        row["floor_tokens_per_s"] = floor * rows_in_batch if floor else None
        row["floor_fraction"] = row["qkv"] / row["floor_tokens_per_s"] if floor else None
        rows.append(row)
    return {"weight_bytes": weight_bytes(model), "rows": rows}


def memory() -> dict:
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    out = {}
    for name in ("qkv", "transformers"):
        text = subprocess.run([sys.executable, __file__, "--child", name, "--threads", str(torch.get_num_threads())],
                              env=env, capture_output=True, text=True, check=True).stdout
        out[name] = json.loads(text.strip().splitlines()[-1])["peak_bytes"]
    return {**out, "ratio": out["qkv"] / out["transformers"]}


def memory_child(name: str) -> dict:
    hf, model, _ = model_pair()
    module = model if name == "qkv" else hf
    del hf, model
    step = qkv_step(module) if name == "qkv" else hf_step(module)
    module.train()
    before = status_kib("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # reset the peak (VmHWM) to the current RSS
    step()
    return {"peak_bytes": (status_kib("VmHWM") - before) * 1024}


def status_kib(field: str) -> int:
    """A memory figure of this process from /proc/self/status, in KiB (VmRSS: now, VmHWM: the peak)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


# -------------------------------------------------------------------------------------------- the table
def print_table(results: dict) -> None:
    m = results.get("machine", {})
    print(f"machine: {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, "
          f"torch {torch.__version__}, transformers {transformers.__version__}")
    if m:
        print(f"  fp32 matmul {m['matmul_flops_per_s'] / 1e9:.1f} GFLOP/s ({m['matmul_flops_per_cpu_s'] / 1e9:.1f} per "
              f"CPU-second), copy {m['copy_bytes_per_s'] / 1e9:.1f} GB/s")
    for t in [results[key] for key in ("train", "train_bf16") if key in results]:
        print(f"training, GPT-2 {LAYERS}L {D}D V={VOCAB}, batch {BATCH} x {SEQ}, AdamW, {t['precision']} "
              f"({t['flops_per_token'] / 1e6:.1f} MFLOP/token)")
        print(f"  {'':<13} {'tokens/s':>9} {'GFLOP/s':>8} {'% matmul':>9} {'GFLOP/CPU-s':>12} {'% matmul':>9}")
        for name in [n for n in ("qkv", "qkv compiled", "transformers") if n in t]:
            r = t[name]
            print(f"  {name:<13} {r['tokens_per_s']:>9.0f} {r['flops_per_s'] / 1e9:>8.1f} "
                  f"{100 * r['matmul_fraction']:>8.0f}% {r['flops_per_cpu_s'] / 1e9:>12.1f} "
                  f"{100 * r['matmul_cpu_fraction']:>8.0f}%")
        print(f"  qkv / transformers: {t['ratio']:.2f}x wall clock, {t['cpu_ratio']:.2f}x in CPU seconds "
              f"(goal >= 1.3x, >= 70% of the matmul rate)")
        if "qkv compiled" in t:
            print(f"  torch.compile: first step (the compile) {t['compile_seconds']:.1f} s; compiled / eager "
                  f"{t['qkv compiled']['tokens_per_s'] / t['qkv']['tokens_per_s']:.3f}x tokens/s")
    if "memory" in results:
        r = results["memory"]
        print(f"training step peak memory: qkv {r['qkv'] / MIB:.0f} MiB, transformers "
              f"{r['transformers'] / MIB:.0f} MiB, ratio {r['ratio']:.2f} (goal <= 1)")
    if "decode" in results:
        d = results["decode"]
        print(f"greedy decoding, {decode_bench.PROMPT} prompt + {decode_bench.NEW} new tokens, "
              f"weights {d['weight_bytes'] / MIB:.1f} MiB per step")
        print(f"  {'batch':>5} {'qkv tok/s':>10} {'hf tok/s':>9} {'qkv/hf':>7} {'(CPU s)':>8} {'floor tok/s':>12} "
              f"{'% floor':>8}  same")
        for r in d["rows"]:
            floor = f"{r['floor_tokens_per_s']:.0f}" if r["floor_tokens_per_s"] else "-"
            share = f"{100 * r['floor_fraction']:.0f}%" if r["floor_fraction"] else "-"
            print(f"  {r['batch']:>5} {r['qkv']:>10.1f} {r['transformers']:>9.1f} {r['ratio']:>7.2f} "
                  f"{r['cpu_ratio']:>8.2f} {floor:>12} {share:>8}  {'yes' if r['same'] else 'no'}")
        print("  (goal >= 1.5x transformers, >= 80% of the floor)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=("train", "decode", "memory", "machine", "all"), default="all")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    parser.add_argument("--threads", type=int, default=0, help="torch intra-op threads; 0 keeps the default")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--compile", action="store_true", help="also time qkv's model under torch.compile")
    parser.add_argument("--bf16", choices=("auto", "yes", "no"), default="auto",
                        help="also train both under bf16 autocast (auto: where the CPU multiplies bf16 natively)")
    parser.add_argument("--child", choices=("qkv", "transformers"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.child:
        print(json.dumps(memory_child(args.child)))
        return
    if args.json is not None and args.json.exists():
        parser.error(f"{args.json} exists; not overwriting it")
    parts = ("machine", "train", "memory", "decode") if args.part == "all" else (args.part,)
    results = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "threads": torch.get_num_threads(),
               "torch": torch.__version__, "transformers": transformers.__version__,
               "machine": machine(args.repeats) if {"machine", "train", "decode"} & set(parts) else {}}
    if "train" in parts or "decode" in parts:
        hf, model, cfg = model_pair()
        ids = batch()[0][:2, :16]
        with torch.no_grad():
            results["logits_gap"] = float((hf(ids).logits - model(ids)).abs().max())
        if "train" in parts:
            results["train"] = train(args.repeats, hf, model, cfg, results["machine"], args.compile)
            if args.bf16 == "yes" or (args.bf16 == "auto" and hardware.native_bf16_cpu()):
                hf, model, cfg = model_pair()
                results["train_bf16"] = train(args.repeats, hf, model, cfg, results["machine"], args.compile, "bf16")
        if "decode" in parts:
            hf, model, cfg = model_pair()  # fresh weights: training steps changed them
            results["decode"] = decode(args.repeats, hf.eval(), model.eval(), results["machine"]["copy_bytes_per_s"])
    if "memory" in parts:
        results["memory"] = memory()
    print_table(results)
    if "logits_gap" in results:
        print(f"max |logits(qkv) - logits(transformers)| on one batch: {results['logits_gap']:.2e}")
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=1))
        print(f"figures written to {args.json}")


if __name__ == "__main__":
    main()
