"""A real model on the CPU at each precision: qkv against llama.cpp (and transformers), decode and prefill speed,
and what each precision does to the model's predictions.

    python benchmarks/real_decode.py [--smollm2 PATH] [--new 128] [--repeats 3] [--threads 2]
        [--precisions fp32 bf16 int8 int4] [--no-llama] [--no-transformers] [--quality-positions 2000]
        [--batches 1 4 16 32] [--compile] [--kv-dtype fp16|bf16] [--json out.json]

One GGUF file (SmolLM2-135M-Instruct, Q4_1). qkv loads it once and runs it at each precision (`--dtype`,
`--quant`: qkv.generate.weights); llama.cpp (llama-cpp-python, built from source: a benchmark dependency, never a
runtime one) runs the file itself for Q4_1 and files qkv writes from it (`qkv convert --to-gguf`) for F32, BF16
and Q8_0, so all hold the same weights up to each format's rounding. Pairs: fp32 / F32, bf16 / BF16,
int8 / Q8_0, int4 / Q4_1. transformers (`from_pretrained(gguf_file=...)`, its own `generate`) at fp32 and bf16.

Speed, batch 1, greedy, `--new` tokens after a short prompt and after a ~500-token prompt (a passage of Hamlet):
prefill tok/s = prompt tokens / time to the first new token; decode tok/s = the other new tokens / their time,
both from one call's clock read at each new token (qkv's on_token, llama.cpp's token stream, a transformers
streamer).
Engines alternate within each repeat; medians are reported. The bandwidth floor of a decode step is the bytes
of weights it reads / the machine's copy bandwidth (read + write of a 256 MiB copy, as benchmarks/run.py).

Batched decode (`--batches`): B copies of the short prompt decoded together, greedy, `--new` tokens each;
aggregate decode tok/s = B x (new - 1) / the time after the first new token. qkv runs `generate` on B rows
(the batched step `qkv serve` runs underneath); llama.cpp runs B sequences in one llama_batch per step through
llama-cpp-python's low-level API (what llama.cpp's own llama-batched-bench measures as text generation speed).
Alternating, medians of `--repeats`.

`--compile`: each precision also with the compiled decoding step (`qkv generate --compile`,
qkv.generate.compiled), its first start (compiling, or finding inductor's cache) timed and reported apart.
`--kv-dtype`: qkv's KV caches in that dtype (`qkv generate --kv-dtype`; llama.cpp keeps fp16 by default), its
rounding included in qkv's quality figures (the logits then come through the cache).

Quality, over `--quality-positions` positions of held-out text (the start of Hamlet, windows of 512): each
precision's top-1 agreement with qkv fp32, KL(fp32 || precision) in nats per position, and bits per byte; the
same for llama.cpp's Q4_1 (its logits through `logits_all`).
"""
from __future__ import annotations

import argparse
import copy
import ctypes
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path

import torch
import torch.nn.functional as F

import qkv
from qkv import hardware
from qkv.data.corpus import bundled_documents
from qkv.generate import compiled, generate, weights
from qkv.generate.weights import prepare, set_kv_dtype, weight_bytes

MIB = 2 ** 20
PAIRS = {"fp32": ("fp32", "none", "f32"), "bf16": ("bf16", "none", "bf16"), "int8": ("fp32", "int8", "q8_0"),
         "int4": ("fp32", "int4", None), "shipped": ("fp32", None, None)}
# precision -> qkv dtype, qkv quant (None: the file's blocks as shipped, qkv's default), the GGUF type llama.cpp runs
# (None: the file itself)
LLAMA_NAMES = {"fp32": "F32", "bf16": "BF16", "int8": "Q8_0", "int4": "Q4_1", "shipped": "as shipped"}
SHORT = "The capital of France is"


def hamlet() -> str:
    return next(d.text for d in bundled_documents() if d.id.lower().startswith("hamlet"))


def copy_bandwidth() -> float:
    src = torch.ones(64 * MIB)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = min(_timed(lambda: dst.copy_(src)) for _ in range(5))
    return 2 * src.numel() * 4 / best


def _speeds(prompt: int, start: float, stamps: list[float]) -> tuple[float, float]:
    """prefill tok/s (the prompt's tokens / the time to the first new token) and decode tok/s (the other new
    tokens / the time from the first to the last), from one call's clock at each new token."""
    return prompt / (stamps[0] - start), (len(stamps) - 1) / max(stamps[-1] - stamps[0], 1e-9)


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


# ------------------------------------------------------------------------------------------------ qkv
class QkvEngine:
    def __init__(self, model, tokenizer, dtype: str, quant: str | None, kv: str | None = None):
        self.model = copy.deepcopy(model)
        self.description = prepare(self.model, dtype=dtype, quant=quant)
        set_kv_dtype(self.model, kv)
        self.tokenizer = tokenizer
        self.bytes = decode_bytes(self.model)

    def run(self, ids: list[int], new: int) -> tuple[float, float, list[int]]:
        stamps = []  # after each new token, in one call (as LlamaEngine times llama.cpp's)
        with torch.no_grad():
            start = time.perf_counter()
            out = generate(self.model, torch.tensor([ids]), max_new_tokens=new,
                           on_token=lambda step, tokens: stamps.append(time.perf_counter()))
        return (*_speeds(len(ids), start, stamps), out[0, len(ids):].tolist())

    def logits(self, ids: list[int]) -> torch.Tensor:
        """(T, V) logits of a forward over `ids`; through a KV cache when it holds another dtype (its rounding
        of K and V then shows, as in decoding)."""
        cache = self.model.new_cache(1, len(ids)) if self.model.kv_dtype is not None else None
        with torch.no_grad():
            return self.model(torch.tensor([ids]), cache=cache)[0].float()


def decode_bytes(model) -> int:
    """Bytes one decode step reads: every weight once, the embedding table not (one row is looked up) unless
    it is also the head (a table looked up in a quantized head's blocks holds none of its own)."""
    total, emb = weight_bytes(model), getattr(model.tok_emb, "weight", None)  # (None: qkv.nn.embedding.QuantEmbedding)
    tied = emb is None or isinstance(model.lm_head, torch.nn.Linear) and model.lm_head.weight is emb  # the whole table
    return total if tied else total - emb.numel() * emb.element_size()


# ------------------------------------------------------------------------------------------ llama.cpp
class LlamaEngine:
    def __init__(self, path: Path, threads: int, logits_all: bool = False):
        from llama_cpp import Llama

        self.llm = Llama(model_path=str(path), n_ctx=1024, n_batch=512, n_threads=threads,
                         n_threads_batch=threads, logits_all=logits_all, verbose=False)
        self.path, self.bytes = path, path.stat().st_size

    def run(self, ids: list[int], new: int) -> tuple[float, float, list[int]]:
        self.llm.reset()
        out, stamps, start = [], [], time.perf_counter()
        for token in self.llm.generate(ids, top_k=1, top_p=1.0, temp=0.0, repeat_penalty=1.0, reset=True):
            out.append(token)
            stamps.append(time.perf_counter())
            if len(out) == new:
                break
        return (*_speeds(len(ids), start, stamps), out)

    def logits(self, ids: list[int]) -> torch.Tensor:
        self.llm.reset()
        self.llm.eval(ids)
        return torch.tensor(self.llm.scores[:len(ids)], dtype=torch.float32)


class LlamaBatched:
    """llama.cpp decoding B sequences at once: one llama_batch per step holding each sequence's next token."""

    def __init__(self, path: Path, threads: int, batch: int, length: int, flash: bool = True):
        import llama_cpp as L

        self.L, self.batch = L, batch
        L.llama_backend_init()
        params = L.llama_model_default_params()
        self.model = L.llama_model_load_from_file(str(path).encode(), params)
        ctx = L.llama_context_default_params()
        ctx.n_ctx = batch * length  # each sequence gets its share
        ctx.n_batch = ctx.n_ubatch = max(512, batch * 8)
        ctx.n_seq_max = batch
        # llama.cpp's default, auto (flash attention on, on a CPU): 246 against 209 tok/s with it off at 16
        # sequences of SmolLM2 Q4_1 on the Xeon with AMX. Off, one sequence gives LlamaEngine's tokens exactly.
        ctx.flash_attn_type = -1 if flash else 0
        ctx.n_threads = ctx.n_threads_batch = threads
        self.ctx = L.llama_init_from_model(self.model, ctx)
        self.vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(self.model))
        self.llama_batch = L.llama_batch_init(ctx.n_batch, 0, batch)

    def decode(self, entries: list[tuple[int, int, int, bool]]) -> None:  # (token, position, sequence, logits?)
        b = self.llama_batch
        b.n_tokens = len(entries)
        for i, (token, pos, seq, logits) in enumerate(entries):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = token, pos, 1, logits
            b.seq_id[i][0] = seq
        if self.L.llama_decode(self.ctx, b) != 0:
            raise RuntimeError("llama_decode failed")

    def argmax(self, index: int) -> int:
        logits = self.L.llama_get_logits_ith(self.ctx, index)
        return int(torch.frombuffer((ctypes.c_float * self.vocab).from_address(ctypes.addressof(logits.contents)),
                                    dtype=torch.float32).argmax())

    def run(self, ids: list[int], new: int) -> tuple[float, list[list[int]]]:
        """Aggregate decode tok/s and each sequence's tokens."""
        self.L.llama_memory_clear(self.L.llama_get_memory(self.ctx), True)
        n = len(ids)
        self.decode([(t, p, s, p == n - 1) for s in range(self.batch) for p, t in enumerate(ids)])
        outs = [[self.argmax(s * n + n - 1)] for s in range(self.batch)]
        start = time.perf_counter()
        for step in range(1, new):
            self.decode([(outs[s][-1], n + step - 1, s, True) for s in range(self.batch)])
            for s in range(self.batch):
                outs[s].append(self.argmax(s))
        return self.batch * (new - 1) / (time.perf_counter() - start), outs


def qkv_batched(engine: QkvEngine, ids: list[int], new: int, batch: int) -> tuple[float, list[list[int]]]:
    """qkv's batched decode of `batch` copies of `ids`: aggregate decode tok/s after the first new token."""
    stamps = []
    with torch.no_grad():
        out = generate(engine.model, torch.tensor([ids] * batch), max_new_tokens=new,
                       on_token=lambda step, tokens: stamps.append(time.perf_counter()))
    return batch * (new - 1) / (stamps[-1] - stamps[0]), out[:, len(ids):].tolist()


# --------------------------------------------------------------------------------------- transformers
class HfEngine:
    def __init__(self, path: Path, dtype: torch.dtype):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                          torch_dtype=dtype).eval()
        self.bytes = sum(p.numel() * p.element_size() for p in self.model.parameters())

    def run(self, ids: list[int], new: int) -> tuple[float, float, list[int]]:
        stamps = []  # a streamer (transformers' interface): put(the prompt), then put(each new token), end()
        streamer = types.SimpleNamespace(put=lambda value: stamps.append(time.perf_counter()), end=lambda: None)
        with torch.no_grad():
            start = time.perf_counter()
            out = self.model.generate(torch.tensor([ids]), max_new_tokens=new, min_new_tokens=new, do_sample=False,
                                      pad_token_id=0, streamer=streamer)
        return (*_speeds(len(ids), start, stamps[1:]), out[0, len(ids):].tolist())


# -------------------------------------------------------------------------------------------- quality
def quality(reference, engine, ids: list[int], positions: int, text_bytes: float) -> dict:
    """Top-1 agreement with and KL from the reference over `positions` positions (windows of 512), and bits
    per byte of the engine's own predictions of the next token."""
    agree, kl, nll, count = 0, 0.0, 0.0, 0
    for start in range(0, positions, 512):
        window = ids[start:start + 513]
        if len(window) < 2:
            break
        ref = reference.logits(window[:-1]).log_softmax(-1)
        got = engine.logits(window[:-1]).log_softmax(-1)
        target = torch.tensor(window[1:])
        agree += int((ref.argmax(-1) == got.argmax(-1)).sum())
        kl += float(F.kl_div(got, ref, log_target=True, reduction="sum"))
        nll += float(F.nll_loss(got, target, reduction="sum"))
        count += len(target)
    return {"positions": count, "top1_agreement": agree / count, "kl": kl / count,
            "bits_per_byte": nll / math.log(2) / (text_bytes * count)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smollm2", type=Path, default=Path(os.environ.get(
        "QKV_SMOLLM2", Path.home() / ".cache/qkv-models/SmolLM2-135M-Instruct.Q4_1.gguf")))
    parser.add_argument("--new", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--precisions", nargs="+", choices=list(PAIRS), default=list(PAIRS))
    parser.add_argument("--no-llama", action="store_true")
    parser.add_argument("--no-transformers", action="store_true")
    parser.add_argument("--no-speed", action="store_true")
    parser.add_argument("--quality-positions", type=int, default=2000)
    parser.add_argument("--batches", type=int, nargs="*", default=[], help="batched decode at these batch sizes")
    parser.add_argument("--compile", action="store_true", help="also qkv with the compiled step (qkv --compile)")
    parser.add_argument("--kv-dtype", choices=("fp16", "bf16"), help="qkv's KV caches in this dtype")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    tmp = Path(tempfile.mkdtemp(prefix="qkv-real-decode-"))
    run = qkv.load(args.smollm2)
    shipped = weights.load(args.smollm2).model if "shipped" in args.precisions else None  # (qkv's default)
    tokenizer = run.tokenizer
    text = hamlet()
    long_ids = [tokenizer.start_id] + tokenizer.encode(text[:2400])[:500]
    short_ids = [tokenizer.start_id] + tokenizer.encode(SHORT)
    quality_ids = [tokenizer.start_id] + tokenizer.encode(text[:40_000])
    quality_ids = quality_ids[:args.quality_positions + 1]
    bytes_per_token = len(tokenizer.decode(quality_ids[1:]).encode()) / max(len(quality_ids) - 1, 1)

    engines: dict[str, object] = {}
    for precision in args.precisions:
        dtype, quant, gguf_type = PAIRS[precision]
        if precision == "bf16" and not hardware.native_bf16_cpu():
            print("note: this CPU has no native bf16; the bf16 rows are emulated")
        model = shipped if quant is None else run.model
        engines[f"qkv {precision}"] = QkvEngine(model, tokenizer, dtype, quant, args.kv_dtype)
        if args.compile:  # the first step compiles (or finds inductor's cache): timed apart
            fast = QkvEngine(model, tokenizer, dtype, quant, args.kv_dtype)
            compiled.enable(fast.model)
            fast.compile_seconds = _timed(lambda: fast.run(short_ids, 3))
            print(f"qkv {precision} compiled: first start {fast.compile_seconds:.1f} s", flush=True)
            engines[f"qkv {precision} compiled"] = fast
        if not args.no_llama:
            path = args.smollm2
            if gguf_type is not None:
                path = tmp / f"smollm2-{gguf_type}.gguf"
                subprocess.run([sys.executable, "-m", "qkv", "convert", str(args.smollm2), "--to-gguf", str(path),
                                "--dtype", gguf_type], check=True, stdout=subprocess.DEVNULL)
            engines[f"llama.cpp {LLAMA_NAMES[precision]}"] = LlamaEngine(path, args.threads)
        if not args.no_transformers and precision in ("fp32", "bf16"):
            engines[f"transformers {precision}"] = HfEngine(args.smollm2, {"fp32": torch.float32,
                                                                           "bf16": torch.bfloat16}[precision])
    bandwidth = copy_bandwidth()
    results = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": platform.processor()
               or platform.machine(), "native_bf16": hardware.native_bf16_cpu(), "threads": args.threads,
               "torch": torch.__version__, "bandwidth_bytes_per_s": bandwidth, "kv_dtype": args.kv_dtype, "engines": {}}
    if not args.no_speed:
        timings = {name: {"short": [], "long": []} for name in engines}
        for name, engine in engines.items():  # warm-up
            engine.run(short_ids, 8)
        for _ in range(args.repeats):
            for name, engine in engines.items():
                for label, ids in (("short", short_ids), ("long", long_ids)):
                    timings[name][label].append(engine.run(ids, args.new)[:2])
        for name, engine in engines.items():
            row = {"weight_bytes": engine.bytes, "floor_tokens_per_s": bandwidth / engine.bytes}
            if hasattr(engine, "compile_seconds"):
                row["compile_seconds"] = engine.compile_seconds
            for label in ("short", "long"):
                row[f"prefill_{label}"] = statistics.median(t[0] for t in timings[name][label])
                row[f"decode_{label}"] = statistics.median(t[1] for t in timings[name][label])
            results["engines"][name] = row
    if args.batches:
        results["batched"] = batched(engines, args, short_ids, tmp)
    if args.quality_positions:
        reference = (None if args.kv_dtype else engines.get("qkv fp32")) or QkvEngine(run.model, tokenizer, "fp32",
                                                                                      "none")  # (an fp32 cache)
        for name, engine in list(engines.items()):
            if name.startswith("transformers") or name.endswith("compiled"):  # (compiled: the same full forward)
                continue
            if name.startswith("llama.cpp"):
                if not ("Q4_1" in name or "shipped" in name):
                    continue
                engine = LlamaEngine(args.smollm2, args.threads, logits_all=True)
            results["engines"].setdefault(name, {})["quality"] = quality(reference, engine, quality_ids,
                                                                         args.quality_positions, bytes_per_token)
    print_table(results, args)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


def batched(engines: dict, args, ids: list[int], tmp: Path) -> dict:
    """{precision: {batch: {"qkv": tok/s, "llama.cpp": tok/s}}}: batched decode, alternating."""
    out = {}
    for precision in args.precisions:
        qkv_engine = engines[f"qkv {precision}"]
        llama_name = f"llama.cpp {LLAMA_NAMES[precision]}"
        path = engines[llama_name].path if llama_name in engines else None
        out[precision] = {}
        for batch in args.batches:
            peers = {"qkv": lambda b=batch: qkv_batched(qkv_engine, ids, args.new, b)}
            if path is not None:
                llama = LlamaBatched(path, args.threads, batch, len(ids) + args.new + 8)
                peers["llama.cpp"] = lambda llama=llama: llama.run(ids, args.new)
            for peer in peers.values():  # warm-up
                peer()
            rates = {name: [] for name in peers}
            for _ in range(args.repeats):
                for name, peer in peers.items():
                    rates[name].append(peer()[0])
            row = {name: statistics.median(values) for name, values in rates.items()}
            out[precision][batch] = row
            print(f"batched {precision} B={batch}: " + ", ".join(f"{name} {row[name]:.1f} tok/s" for name in peers),
                  flush=True)
    return out


def print_table(results: dict, args) -> None:
    print(f"{results['date']}, {results['machine']}, native bf16: {results['native_bf16']}, {results['threads']} "
          f"threads, torch {results['torch']}; copy bandwidth {results['bandwidth_bytes_per_s'] / 1e9:.1f} GB/s"
          + (f"; qkv's KV cache in {args.kv_dtype}" if args.kv_dtype else ""))
    print(f"{'engine':<22} {'decode tok/s':>15} {'prefill tok/s':>15} {'MiB read':>9} {'% floor':>8} "
          f"{'top-1':>7} {'KL':>8} {'bits/B':>7}")
    for name, row in results["engines"].items():
        q = row.get("quality", {})
        speed = (f"{row['decode_short']:>6.1f} / {row['decode_long']:<6.1f} {row['prefill_short']:>6.0f} / "
                 f"{row['prefill_long']:<6.0f} {row['weight_bytes'] / MIB:>9.0f} "
                 f"{100 * row['decode_short'] / row['floor_tokens_per_s']:>7.0f}%") if "decode_short" in row else \
            f"{'':>50}"
        quality = (f" {100 * q['top1_agreement']:>6.1f}% {q['kl']:>8.5f} {q['bits_per_byte']:>7.4f}"
                   if q else "")
        print(f"{name:<22} {speed}{quality}")
    starts = [f"{name[4:]} {row['compile_seconds']:.0f} s" for name, row in results["engines"].items()
              if "compile_seconds" in row]
    if starts:
        print("compiled step, first start (compile, or inductor's cache): " + ", ".join(starts))
    print(f"(decode and prefill: short prompt / ~500-token prompt, {args.new} new tokens, batch 1, medians of "
          f"{args.repeats}; quality over {args.quality_positions} positions of Hamlet against qkv fp32)")
    if results.get("batched"):
        print("batched decode, aggregate tok/s (qkv / llama.cpp), the short prompt in every row:")
        for precision, rows in results["batched"].items():
            cells = [f"B={b}: {row['qkv']:.0f} / {row.get('llama.cpp', float('nan')):.0f}" for b, row in rows.items()]
            print(f"  {precision:<5} " + "  ".join(cells))


if __name__ == "__main__":
    main()
