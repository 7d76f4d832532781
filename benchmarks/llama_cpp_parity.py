"""llama.cpp (llama-cpp-python, built from source; a benchmark dependency, never a runtime one) reads the GGUF
files `qkv convert --to-gguf` writes and greedily generates what `qkv generate` generates.

    python benchmarks/llama_cpp_parity.py [--smollm2 PATH] [--tokens 64]

For each model: the prompt's ids from each side's own tokenizer, then 64 greedy tokens from llama.cpp and from
qkv on the same f32 file; prints the texts and whether the ids agree. The models: SmolLM2-135M-Instruct read
from its GGUF file and written back out at f32 by qkv, and a `tiny` preset run trained here by `qkv train`
(a GPT-2 shape with qkv's own BPE tokenizer).
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

import qkv
from qkv.generate import generate

PROMPTS = ["The capital of France is", "To be, or not to be, that is"]


def llama_cpp_greedy(path: Path, prompt: str, tokens: int) -> tuple[list[int], list[int]]:
    from llama_cpp import Llama

    context = qkv.load(path).config.model.max_seq_len  # learned positions have no row past it
    llm = Llama(model_path=str(path), n_ctx=min(512, context), n_threads=2, verbose=False)
    ids = llm.tokenize(prompt.encode(), add_bos=True, special=True)
    tokens = min(tokens, context - len(ids))
    out = []
    for token in llm.generate(ids, top_k=1, top_p=1.0, temp=0.0, repeat_penalty=1.0):
        if token == llm.token_eos() or len(out) == tokens:
            break
        out.append(token)
    return ids, out


def qkv_greedy(path: Path, prompt: str, tokens: int) -> tuple[list[int], list[int]]:
    run = qkv.load(path)
    ids = [run.tokenizer.eos_id] + run.tokenizer.encode(prompt)  # as `qkv generate` starts a prompt
    tokens = min(tokens, run.config.model.max_seq_len - len(ids))
    out = generate(run.model, torch.tensor([ids]), max_new_tokens=tokens, strategy="greedy",
                   stop_tokens=run.stop_ids)[0, len(ids):].tolist()
    return ids, [t for t in out if t not in run.stop_ids]


def compare(name: str, path: Path, tokens: int) -> bool:
    run = qkv.load(path)
    same = True
    for prompt in PROMPTS:
        (ours_in, ours), (theirs_in, theirs) = qkv_greedy(path, prompt, tokens), llama_cpp_greedy(path, prompt, tokens)
        agree = ours_in == theirs_in and ours == theirs[:len(ours)] and len(theirs) >= len(ours)
        same &= agree
        print(f"{name} | {prompt!r}: prompt ids equal {ours_in == theirs_in}; {len(ours)} qkv tokens, "
              f"{len(theirs)} llama.cpp tokens, equal {agree}")
        print(f"   qkv:       {run.tokenizer.decode(ours)!r}")
        print(f"   llama.cpp: {run.tokenizer.decode(theirs)!r}")
    return same


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smollm2", default=os.environ.get("QKV_SMOLLM2",
                                                            Path.home() / ".cache/qkv-models/SmolLM2-135M-Instruct.Q4_1.gguf"))
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp())
    qkv_cmd = [sys.executable, "-m", "qkv"]
    subprocess.run(qkv_cmd + ["convert", str(args.smollm2), "--to-gguf", str(tmp / "smollm2-f32.gguf")], check=True)
    subprocess.run(qkv_cmd + ["train", "--preset", "tiny", "--max-steps", "200", "--out", str(tmp / "tiny"),
                              "--quiet", "--no-sample"], check=True, stdout=subprocess.DEVNULL)
    subprocess.run(qkv_cmd + ["convert", str(tmp / "tiny"), "--to-gguf", str(tmp / "tiny-f32.gguf")], check=True)
    results = [compare("SmolLM2 f32 (written by qkv)", tmp / "smollm2-f32.gguf", args.tokens),
               compare("qkv tiny run (f32)", tmp / "tiny-f32.gguf", args.tokens)]
    print("all equal:", all(results))
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main())
