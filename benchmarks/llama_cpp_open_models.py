"""llama.cpp (llama-cpp-python, built from source; a benchmark dependency, never a runtime one) as the oracle of the
open-model architectures qkv writes to GGUF: Llama 3.x (llama3-scaled RoPE as rope_freqs.weight), Qwen3 and
Gemma 3, each a random model built with transformers' own class, written by `qkv convert --to-gguf` at f32, and
read by llama.cpp; and the real Gemma 3 270M file.

    python benchmarks/llama_cpp_open_models.py [--gemma3 PATH] [--tokens 32]

For each random model: the logits of 40 random ids from llama.cpp (every position) against qkv's of the same
file, the largest difference relative to the largest logit, and 32 greedy tokens from each. For Gemma 3 270M: qkv's
reading of the Q4_K_M file written back at f32 and read by llama.cpp (the same weights): the logits on a prompt,
greedy tokens; and llama.cpp on the file as shipped against qkv, top-1 agreement over the prompt's positions
(llama.cpp multiplies K-quants with 8-bit activations, so those logits differ by more than rounding).
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import tempfile
from pathlib import Path

import numpy as np
import torch

import qkv
from qkv.data.tokenizer import Tokenizer
from qkv.formats.gguf import save
from qkv.generate import generate

F32 = 0  # GGML_TYPE_F32
TEXT = ["To be, or not to be, that is the question:", "Whether 'tis nobler in the mind to suffer"] * 20


def llama_cpp_logits(path: Path, ids: list[int]) -> np.ndarray:
    from llama_cpp import Llama

    llm = Llama(model_path=str(path), n_ctx=256, n_threads=2, logits_all=True, verbose=False,
                type_k=F32, type_v=F32)  # an f32 KV cache (llama.cpp's default is f16)
    llm.eval(ids)
    return np.array(llm.scores[:len(ids)], dtype=np.float64)


def llama_cpp_greedy(path: Path, ids: list[int], tokens: int) -> list[int]:
    from llama_cpp import Llama

    llm = Llama(model_path=str(path), n_ctx=256, n_threads=2, verbose=False)
    out = []
    for token in llm.generate(ids, top_k=1, top_p=1.0, temp=0.0, repeat_penalty=1.0):
        out.append(token)
        if len(out) == tokens:
            break
    return out


def random_models(vocab: int):
    import transformers

    torch.manual_seed(0)
    small = dict(vocab_size=vocab, hidden_size=128, intermediate_size=192, num_attention_heads=2,
                 max_position_embeddings=256, tie_word_embeddings=True)
    yield "llama3", transformers.LlamaForCausalLM(transformers.LlamaConfig(
        **small, num_hidden_layers=2, num_key_value_heads=1,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}))
    yield "qwen3", transformers.Qwen3ForCausalLM(transformers.Qwen3Config(
        **small, num_hidden_layers=2, num_key_value_heads=1, head_dim=96))
    yield "gemma3", transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(
        **small, num_hidden_layers=7, num_key_value_heads=1, head_dim=96, query_pre_attn_scalar=96,
        sliding_window=8))


def perturb(model):
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(0.0, 0.3)
    return model.eval()


def check(name: str, path: Path, run, ids: list[int], tokens: int) -> None:
    theirs = llama_cpp_logits(path, ids)
    with torch.no_grad():
        ours = run.model(torch.tensor([ids]))[0].double().numpy()
    relative = float(np.abs(ours - theirs).max() / np.abs(theirs).max())
    greedy = generate(run.model, torch.tensor([ids]), max_new_tokens=tokens, strategy="greedy")[0, len(ids):].tolist()
    theirs_greedy = llama_cpp_greedy(path, ids, tokens)
    same = sum(a == b for a, b in zip(greedy, theirs_greedy))
    print(f"{name:8s} logits: max |qkv - llama.cpp| = {np.abs(ours - theirs).max():.2e}, / max |logit| = "
          f"{relative:.2e}; greedy {same}/{tokens} "
          f"tokens equal ({'identical' if greedy == theirs_greedy else 'DIFFER'})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gemma3", default=os.environ.get("QKV_GEMMA3") or
                        str(Path.home() / ".cache/qkv-models/gemma-3-270m-q4_k_m.gguf"))
    parser.add_argument("--tokens", type=int, default=32)
    args = parser.parse_args()
    tokenizer = Tokenizer.train(TEXT, 300)
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as tmp:
        for name, model in random_models(tokenizer.vocab_size):
            perturb(model).save_pretrained(Path(tmp) / name)
            run = dataclasses.replace(qkv.load(Path(tmp) / name), tokenizer=tokenizer)
            path = save(run, Path(tmp) / f"{name}.gguf", "f32")
            check(name, path, qkv.load(path), rng.integers(3, tokenizer.vocab_size, 40).tolist(), args.tokens)
        shipped = Path(args.gemma3)
        if not shipped.is_file():
            print(f"no {shipped}: the real Gemma 3 270M is skipped")
            return
        run = qkv.load(shipped)
        ids = [run.tokenizer.start_id] + run.tokenizer.encode("The capital of France is Paris. The capital of Italy is")
        written = save(run, Path(tmp) / "gemma3-270m-f32.gguf", "f32")
        check("270M f32", written, run, ids, args.tokens)
        theirs = llama_cpp_logits(shipped, ids)
        with torch.no_grad():
            ours = run.model(torch.tensor([ids]))[0].double().numpy()
        agree = float((theirs.argmax(-1) == ours.argmax(-1)).mean())
        print(f"270M as shipped (Q4_K_M): top-1 agreement with qkv over {len(ids)} positions {agree:.3f}; "
              f"max |diff| / max |logit| {np.abs(ours - theirs).max() / np.abs(theirs).max():.2e}")


if __name__ == "__main__":
    main()
