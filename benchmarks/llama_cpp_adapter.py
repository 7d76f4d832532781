"""When to ship a LoRA adapter and when to merge it: SmolLM2-135M-Instruct (the Q4_1 file as shipped) after a short
LoRA SFT run (the speller demo's rows, r=16, alpha=32 on the seven projections), in llama.cpp (llama-cpp-python,
built from source; a benchmark dependency, never a runtime one) and in qkv.

    python benchmarks/llama_cpp_adapter.py [--steps 4] [--tokens 64] [--rounds 3]

Reported: the bytes of each file; llama.cpp's load time and greedy decode tokens/s with the base alone, the base
plus the GGUF adapter (`qkv convert RUN --to-gguf`: applied at run time, two extra small products a layer), and
the merged model (`qkv convert RUN --merge-lora --to-gguf --dtype q8_0 | q4_0`: requantized with the update in
it); whether each one's greedy tokens on the demo's prompts equal qkv's of the run (fp32, the Q4_1 weights
dequantized); qkv's own load with --adapter FILE.gguf (merged into its fp32 weights at load). Speed rounds
alternate between the files (the machines are noisy).
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import torch

import qkv
from qkv.cli import main as qkv_main
from qkv.formats import merge_adapter
from qkv.generate import generate

PROMPT = "Modern: {}\nFirst Folio:"
PAIRS = [("Shake off their sterile curse.", " Shake off their sterrile curse"),
         ("The air breathes upon us here most sweetly.", " The ayre breathes vpon vs here most sweetly"),
         ("Take thou what course thou wilt!--", " Take thou what course thou wilt.")]


def llama(path: Path, lora: Path | None = None):
    from llama_cpp import Llama

    start = time.perf_counter()
    llm = Llama(model_path=str(path), n_ctx=512, n_threads=2, verbose=False,
                **({"lora_path": str(lora)} if lora else {}))
    return llm, time.perf_counter() - start


def greedy(llm, ids: list[int], tokens: int) -> tuple[list[int], float]:
    llm.reset()
    out, start = [], None
    for token in llm.generate(ids, top_k=1, top_p=1.0, temp=0.0, repeat_penalty=1.0, reset=True):
        if start is None:  # the prompt's prefill is done when the first token comes
            start = time.perf_counter()
        out.append(token)
        if len(out) == tokens:
            break
    return out, (tokens - 1) / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smollm2", default=os.environ.get("QKV_SMOLLM2") or
                        str(Path.home() / ".cache/qkv-models/SmolLM2-135M-Instruct.Q4_1.gguf"))
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    base = Path(args.smollm2)
    root = Path(tempfile.mkdtemp(prefix="qkv-adapter-"))
    rows = [{"prompt": PROMPT.format(m), "completion": f + "\n"} for m, f in PAIRS] * 4
    (root / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert qkv_main(["train", "--task", "sft", "--init", str(base), "--data", str(root / "rows.jsonl"), "--out",
                     str(root / "run"), "--max-steps", str(args.steps), "--lora", "r=16,alpha=32",
                     "--set", "train.lr=1e-2", "--set", "train.seq_len=48", "--set", "train.batch_size=4",
                     "--set", "train.precision=fp32", "--quiet", "--no-sample"]) == 0
    files = {"base (Q4_1, as shipped)": (base, None), "base + adapter (F32)": (base, root / "adapter.gguf"),
             "merged q8_0": (root / "merged-q8_0.gguf", None), "merged q4_0": (root / "merged-q4_0.gguf", None)}
    assert qkv_main(["convert", str(root / "run"), "--to-gguf", str(root / "adapter.gguf")]) == 0
    for dtype in ("q8_0", "q4_0"):
        assert qkv_main(["convert", str(root / "run"), "--merge-lora", "--to-gguf",
                         str(root / f"merged-{dtype}.gguf"), "--dtype", dtype]) == 0
    start = time.perf_counter()
    run = qkv.load(base)
    line = merge_adapter(run, root / "adapter.gguf")
    print(f"qkv: load with --adapter adapter.gguf: {time.perf_counter() - start:.1f} s ({line})")
    expected = []
    for modern, _ in PAIRS:
        ids = run.tokenizer.encode(PROMPT.format(modern))
        expected.append((ids, generate(run.model, torch.tensor([ids]), max_new_tokens=args.tokens,
                                       strategy="greedy")[0, len(ids):].tolist()))
    speeds = {name: [] for name in files}
    loads, agree = {}, {}
    for _ in range(args.rounds):
        for name, (path, lora) in files.items():
            llm, seconds = llama(path, lora)
            loads.setdefault(name, seconds)
            same = 0
            for ids, ours in expected:
                out, rate = greedy(llm, ids, args.tokens)
                speeds[name].append(rate)
                same += out == ours
            agree[name] = same
            del llm
    print(f"\n| llama.cpp, 2 threads | file bytes | load s | decode tok/s (median) | greedy = qkv's, of {len(PAIRS)} |")
    print("|---|---:|---:|---:|---:|")
    for name, (path, lora) in files.items():
        size = path.stat().st_size + (lora.stat().st_size if lora else 0)
        rates = sorted(speeds[name])
        shown = f"{path.stat().st_size:,}" + (f" + {lora.stat().st_size:,}" if lora else "")
        print(f"| {name} | {shown if lora else f'{size:,}'} | {loads[name]:.2f} | {rates[len(rates) // 2]:.1f} | "
              f"{agree[name]} |")


if __name__ == "__main__":
    main()
