"""`qkv train` (every task, engine and layout; docs/training.md) and `qkv presets`."""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path

from qkv.cli.options import main_rank, positive_int, strict_json
from qkv.errors import QkvError
from qkv.train.tasks import TASKS


def add_parsers(sub) -> None:
    train = sub.add_parser("train", help="train a model (default: the shakespeare preset on the bundled corpus)")
    train.add_argument("--preset", help="named configuration (see `qkv presets`); default: shakespeare, or the "
                                        "task's own preset with --task")
    train.add_argument("--task", help="a job for the preset (docs/tasks.md): " + "; ".join(
        f"{name}: {TASKS.get(name).summary}" for name in TASKS.names()))
    train.add_argument("--init", metavar="RUN", help="start from this run's weights (all but the head): fine-tuning")
    train.add_argument("--lora", metavar="SPEC", help="train LoRA adapters over the frozen --init model, e.g. "
                       "r=16,alpha=32,dropout=0.05,targets=q,k,v,o,gate,up,down (or targets=all-linear; QLoRA: "
                       "base=int8|int4); saved in PEFT's format in the run dir (train.lora)")
    train.add_argument("--config", help="JSON file with sections model, train, data, parallel")
    train.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                       help="override one field, e.g. --set model.n_layers=6 (repeatable)")
    train.add_argument("--data", action="append", default=[], metavar="PATH",
                       help="text file, folder of .txt, glob, or .jsonl(.gz) with a text field (repeatable)")
    train.add_argument("--out", help="run directory (default runs/PRESET, never overwritten)")
    train.add_argument("--max-steps", type=positive_int, help="total optimizer steps (also after a resume)")
    train.add_argument("--max-time", type=float, help="seconds of training")
    train.add_argument("--resume", action="store_true", help="continue the run in --out from its last checkpoint")
    train.add_argument("--engine", choices=("torch", "ref"), default="torch",
                       help="torch (autograd) or ref (the NumPy engine with hand-written backward passes)")
    train.add_argument("--no-sample", action="store_true", help="do not print a sample at the end")
    train.add_argument("--quiet", action="store_true", help="no progress bar")
    train.add_argument("--json", action="store_true", help="print the summary as JSON")
    train.add_argument("--yes", action="store_true", help="start a run whose plan takes more than a day on this "
                                                          "machine (without --max-time it is refused)")

    listing = sub.add_parser("presets", help="list the named configurations")
    listing.add_argument("--json", action="store_true")


def cmd_train(args) -> int:
    from qkv.train import job, reference, tasks

    log = (lambda message: print(message, file=sys.stderr)) if main_rank() else (lambda message: None)  # noqa: E731
    if args.resume:
        if not args.out:
            raise QkvError("--resume needs --out RUN_DIR")
        if args.task or args.init or args.lora:
            raise QkvError("--resume continues a run with its own config; --task, --init and --lora start a new one")
        reference.check_engine(args.engine, resume=True, max_time=0.0)
        out = Path(args.out)
        with job.claim(out, resume=True):  # one writer per run dir, from before its config is read
            cfg = job.resume_config(out, args.max_steps, args.max_time, layout=args.set, data=args.data,
                                    config_file=args.config, preset=args.preset)
            return train_into(args, out, cfg, log)
    preset = args.preset or (tasks.TASKS.get(args.task).preset if args.task else "shakespeare")
    cfg = job.resolve_config(preset=preset, config_file=args.config, overrides=args.set, data=args.data,
                             max_steps=args.max_steps, max_time=args.max_time, task=args.task, init=args.init,
                             lora=args.lora)
    reference.check_engine(args.engine, resume=False, max_time=cfg.train.max_time)
    if args.engine == "ref" and (cfg.train.lora or cfg.train.objective == "sft"):
        raise QkvError("--engine ref trains a model from scratch on a token stream; LoRA and SFT run on the torch "
                       "engine (--engine torch)")
    out = Path(args.out) if args.out else job.default_out(f"{preset}-{args.task}" if args.task else preset)
    job.check_launch(cfg)  # before the dir exists: a rank refused under torchrun may be stopped before it cleans up
    with job.claim(out, resume=False):
        return train_into(args, out, cfg, log)


def train_into(args, out: Path, cfg, log) -> int:
    from qkv.models.build import objective_of
    from qkv.nn.lora import trainable_count
    from qkv.train import job, reference

    trainer, cfg = job.start(out, cfg, resume=args.resume, log=log, progress=not args.quiet, confirmed=args.yes)
    trainable, total = trainable_count(trainer.model)
    what = f"{total:,} parameters" if trainable == total else \
        f"{trainable:,} of {total:,} parameters ({trainable / total:.2%}: LoRA {cfg.train.lora})"
    log(f"qkv: training {what} into {out} (vocab {cfg.model.vocab_size}, {training_data(trainer.data.train)})")
    try:
        summary = reference.run_reference(trainer) if args.engine == "ref" else trainer.run()
    except KeyboardInterrupt:
        saved = "no checkpoint saved yet" if trainer.saved_step is None else \
            f"checkpoint saved at step {trainer.saved_step}"
        log(f"qkv: interrupted; {saved}; continue with `qkv train --out {out} --resume`")
        return 130
    trainer.gather()  # torchrun: rank 0 gets the whole model and reports; the others are done
    if not trainer.layout.is_main:
        return 0
    summary["run"] = str(out)
    if cfg.train.lora:  # the adapters in PEFT's format, beside the run's own checkpoint
        log(job.write_adapter(trainer, out))
    summary["val_bits_per_char"] = job.bits_per_char(trainer)
    if trainer.objective.report is not None:  # e.g. a classifier's held-out accuracy and its baselines
        summary.update(trainer.objective.report(trainer))
    if args.json:
        print(summary_line(summary))
    else:
        print(describe(summary))
    if not args.no_sample and objective_of(cfg) == "lm":  # only a language model continues text
        print(sample(trainer, cfg))
    return 0


def training_data(train) -> str:
    """What the run trains on, in words: a token stream's tokens, or examples and their tokens."""
    tokens = getattr(train, "tokens", None)
    if hasattr(train, "chosen"):  # qkv.train.dpo.Pairs
        return f"{len(train):,} training pairs, {tokens:,} tokens"
    if isinstance(tokens, int):  # qkv.data.sft.Examples
        return f"{len(train):,} training examples, {tokens:,} tokens"
    return f"{len(train):,} training tokens"


def summary_line(summary: dict) -> str:
    """The summary as strict JSON: a value that is not finite (a NaN loss) is null, never NaN or Infinity."""
    return strict_json(summary)


def describe(summary: dict) -> str:
    bits, val = summary.get("val_bits_per_char"), summary.get("val_loss")
    bits_text = "" if bits is None else f", {bits:.4f} bits/char"
    val_text = "not finite" if val is None or not math.isfinite(val) else f"{val:.4f}"
    counts = (("skipped_steps", "skipped steps"), ("spikes", "loss spikes"))
    trouble = [f"{summary[key]} {name}" for key, name in counts if summary.get(key)]
    trouble_text = f" ({', '.join(trouble)})" if trouble else ""
    rate = f"{summary['tokens_per_s']:,} tokens/s"
    if summary.get("flops_per_s"):
        rate += f", {summary['flops_per_s'] / 1e9:.1f} GFLOP/s"
    if summary.get("mfu"):
        rate += f", MFU {summary['mfu']:.1%}"
    accuracy = [f"{key.replace('_', ' ')} {value:.3f}" for key, value in summary.items()
                if key.endswith(("accuracy", "chrf")) and value is not None]  # held-out figures: classifier, seq2seq
    accuracy_text = "".join(f", {text}" for text in accuracy)
    return (f"qkv: {summary['steps']} steps, {summary['tokens']:,} tokens in {summary['seconds']:.0f} s "
            f"({rate}){trouble_text}; validation loss {val_text}"
            f"{bits_text}{accuracy_text}; run saved in {summary['run']}")


def sample(trainer, cfg, max_new_tokens: int = 200) -> str:
    """A short top-p sample from the trained model, as `qkv generate RUN` writes one with no prompt (from
    end-of-text and a line break: qkv.generate.text.start_of)."""
    import torch

    from qkv.generate import generate
    from qkv.generate.text import start_of

    tokenizer = trainer.data.tokenizer
    start_ids = torch.tensor([start_of(tokenizer, "")], device=trainer.device)
    new = min(max_new_tokens, cfg.model.max_seq_len - start_ids.shape[1])
    ids = generate(trainer.model, start_ids, max_new_tokens=new, strategy="top-p", top_p=0.9, temperature=0.8,
                   seed=cfg.train.seed, stop_tokens=(tokenizer.eos_id,))
    new_ids = ids[0, start_ids.shape[1]:].tolist()
    return "--- sample ---\n" + tokenizer.decode([i for i in new_ids if i != tokenizer.eos_id])


def cmd_presets(args) -> int:
    from qkv import presets

    rows = [{"name": name, "description": presets.describe(name)} for name in presets.PRESETS.names()]
    if args.json:
        print(json.dumps(rows))
    else:
        print("\n".join(f"{row['name']:<14} {row['description']}" for row in rows))
    return 0


COMMANDS = {"train": cmd_train, "presets": cmd_presets}
