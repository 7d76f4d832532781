"""Greedy decoding speed: qkv.generate against transformers' GPT2LMHeadModel.generate, same weights.

A 6-layer, 384-wide, 6-head GPT-2 with an 8192-token vocabulary is built from a config (random
weights, no download) and copied by hand into the equivalent qkv model. Both decode greedily with
their KV caches: 16 prompt tokens + 128 new, batch 1 and 8, runs alternating A B A B; the table
shows the median tokens/s (new tokens x batch / seconds), the qkv / transformers ratio of the
medians and of the best runs, the ratio of their median process CPU seconds (waiting for a core on a
shared machine is not counted: the steadiest of the three there), and whether the two produced the
same tokens. benchmarks/run.py runs this as its decoding part.

    PYTHONPATH=src python benchmarks/generate.py [--repeats 3] [--threads N] [--device cpu|cuda]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers import GPT2Config, GPT2LMHeadModel

import qkv

VOCAB, D, HEADS, LAYERS, CONTEXT = 8192, 384, 6, 6, 256
PROMPT, NEW = 16, 128


def gpt2_pair(device: str) -> tuple[GPT2LMHeadModel, torch.nn.Module]:
    torch.manual_seed(0)
    hf_cfg = GPT2Config(vocab_size=VOCAB, n_positions=CONTEXT, n_embd=D, n_layer=LAYERS, n_head=HEADS,
                        activation_function="gelu_new", layer_norm_epsilon=1e-5, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=None, eos_token_id=None, pad_token_id=0)
    hf = GPT2LMHeadModel(hf_cfg).eval()
    cfg = qkv.ModelConfig(vocab_size=VOCAB, d_model=D, n_heads=HEADS, n_layers=LAYERS, d_ff=4 * D,
                          max_seq_len=CONTEXT, positional="learned", norm="layernorm", norm_eps=1e-5,
                          norm_placement="pre", activation="gelu_tanh", bias=True, tie_embeddings=True)
    model = qkv.build_model(cfg).eval()
    copy_gpt2_weights(hf, model)
    return hf.to(device), model.to(device)


@torch.no_grad()
def copy_gpt2_weights(hf: GPT2LMHeadModel, model: torch.nn.Module) -> None:
    """GPT-2's Conv1D stores W as (in, out) (y = x W + b), nn.Linear as (out, in): transpose; c_attn
    holds W^Q | W^K | W^V side by side."""
    source = hf.transformer
    model.tok_emb.weight.copy_(source.wte.weight)  # (V, D), also lm_head (tied)
    model.positional.weight.copy_(source.wpe.weight)  # (max_seq_len, D)
    for block, layer in zip(model.blocks, source.h):
        copy_norm(block.attn_norm, layer.ln_1)
        copy_norm(block.ffn_norm, layer.ln_2)
        q, k, v = layer.attn.c_attn.weight.T.chunk(3, dim=0)  # each (D, D) as (out, in)
        q_bias, k_bias, v_bias = layer.attn.c_attn.bias.chunk(3)
        for proj, weight, bias in ((block.attn.q_proj, q, q_bias), (block.attn.k_proj, k, k_bias),
                                   (block.attn.v_proj, v, v_bias)):
            proj.weight.copy_(weight)
            proj.bias.copy_(bias)
        copy_conv1d(block.attn.o_proj, layer.attn.c_proj)
        copy_conv1d(block.ffn.up_proj, layer.mlp.c_fc)
        copy_conv1d(block.ffn.down_proj, layer.mlp.c_proj)
    copy_norm(model.final_norm, source.ln_f)


def copy_norm(ours, theirs) -> None:
    ours.weight.copy_(theirs.weight)
    ours.bias.copy_(theirs.bias)


def copy_conv1d(linear, conv) -> None:
    linear.weight.copy_(conv.weight.T)
    linear.bias.copy_(conv.bias)


def timed(fn) -> tuple[float, float, torch.Tensor]:
    """Wall-clock seconds, process CPU seconds and the output of fn()."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start, start_cpu = time.perf_counter(), time.process_time()
    out = fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - start, time.process_time() - start_cpu, out


def run(batch: int, repeats: int, hf, model, device: str) -> dict:
    ids = torch.randint(0, VOCAB, (batch, PROMPT), generator=torch.Generator().manual_seed(batch)).to(device)
    runners = {
        "qkv": lambda: qkv.generate(model, ids, max_new_tokens=NEW, strategy="greedy"),
        "transformers": lambda: hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW,
                                            min_new_tokens=NEW, do_sample=False, num_beams=1, pad_token_id=0),
    }
    for fn in runners.values():  # warm-up
        fn()
    seconds, cpu = {name: [] for name in runners}, {name: [] for name in runners}
    outputs = {}
    for _ in range(repeats):  # alternating A B A B
        for name, fn in runners.items():
            elapsed, elapsed_cpu, outputs[name] = timed(fn)
            seconds[name].append(elapsed)
            cpu[name].append(elapsed_cpu)
    same = outputs["qkv"].shape == outputs["transformers"].shape and torch.equal(outputs["qkv"].cpu(),
                                                                                  outputs["transformers"].cpu())
    agree = (outputs["qkv"][:, PROMPT:] == outputs["transformers"][:, PROMPT:]).float().mean().item()
    rates = {name: NEW * batch / statistics.median(times) for name, times in seconds.items()}
    best = {name: NEW * batch / min(times) for name, times in seconds.items()}
    return {"batch": batch, **rates, "ratio": rates["qkv"] / rates["transformers"],
            "best_ratio": best["qkv"] / best["transformers"], "same": same, "agree": agree,
            "cpu_ratio": statistics.median(cpu["transformers"]) / statistics.median(cpu["qkv"])}


def logits_gap(hf, model, device: str) -> float:
    ids = torch.randint(0, VOCAB, (2, PROMPT), generator=torch.Generator().manual_seed(0)).to(device)
    with torch.no_grad():
        return float((hf(ids).logits - model(ids)).abs().max())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0, help="torch intra-op threads; 0 keeps the default")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    hf, model = gpt2_pair(args.device)
    print(f"GPT-2 {LAYERS}L {D}D {HEADS}H V={VOCAB}, greedy, {PROMPT} prompt + {NEW} new tokens, "
          f"device {args.device}, {torch.get_num_threads()} threads, median of {args.repeats}")
    print(f"max |logits(qkv) - logits(transformers)| on a prompt: {logits_gap(hf, model, args.device):.2e}")
    print(f"{'batch':>5} {'qkv tok/s':>10} {'hf tok/s':>10} {'qkv/hf':>7} {'best-run qkv/hf':>16} {'CPU-s ratio':>12}"
          f"  same tokens")
    for batch in args.batches:
        row = run(batch, args.repeats, hf, model, args.device)
        print(f"{row['batch']:>5} {row['qkv']:>10.1f} {row['transformers']:>10.1f} {row['ratio']:>7.2f} "
              f"{row['best_ratio']:>16.2f} {row['cpu_ratio']:>12.2f}  "
              f"{'yes' if row['same'] else 'no'} ({row['agree']:.1%} of new tokens agree)")


if __name__ == "__main__":
    main()
