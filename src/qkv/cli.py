"""The `qkv` command: argparse sub-commands, wiring only.

Exit codes: 0 done; 2 bad input or usage (one line `qkv: error: ...` on stderr); 1 a bug; 130 interrupted.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import warnings
from pathlib import Path

from qkv import hf_commands
from qkv.analysis import commands as analysis_commands
from qkv.errors import QkvError
from qkv.train.tasks import TASKS

STRATEGIES = ("greedy", "sample", "top-k", "top-p", "beam")


class Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, exit 2 (argparse prints the whole usage otherwise)
        raise QkvError(f"{self.prog.split(' ', 1)[-1] if ' ' in self.prog else 'usage'}: {message}")


def positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def port_number(text: str) -> int:
    value = int(text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be a port number in [0, 65535], got {text}")
    return value


def parser() -> Parser:
    root = Parser(prog="qkv", description="A complete Transformer system built straight from the math.")
    sub = root.add_subparsers(dest="command", required=True, parser_class=Parser)

    train = sub.add_parser("train", help="train a model (default: the shakespeare preset on the bundled corpus)")
    train.add_argument("--preset", help="named configuration (see `qkv presets`); default: shakespeare, or the "
                                        "task's own preset with --task")
    train.add_argument("--task", help="a job for the preset (docs/tasks.md): " + "; ".join(
        f"{name}: {TASKS.get(name).summary}" for name in TASKS.names()))
    train.add_argument("--init", metavar="RUN", help="start from this run's weights (all but the head): fine-tuning")
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

    evaluate = sub.add_parser("eval", help="held-out figures of a run: loss, perplexity and bits per character "
                                           "(LM), masked-token accuracy (MLM), accuracy (classifier)")
    evaluate.add_argument("run", help="run directory")
    evaluate.add_argument("--data", action="append", default=[], metavar="PATH",
                          help="score this text instead of the run's validation split")
    evaluate.add_argument("--stride", type=positive_int, help="sliding-window stride (default: context / 2)")
    evaluate.add_argument("--json", action="store_true")

    generate = sub.add_parser("generate", help="continue a prompt with a trained run")
    generate.add_argument("run", help="run directory")
    generate.add_argument("--prompt", default="", help="text to continue")
    generate.add_argument("--max-new-tokens", type=positive_int, default=200)
    generate.add_argument("--strategy", choices=STRATEGIES,
                          help="default: top-p for a language model, beam for an encoder-decoder")
    generate.add_argument("--temperature", type=float, help="sampling strategies (default 0.8)")
    generate.add_argument("--top-k", type=positive_int, help="top-k (default 50); with top-p both apply")
    generate.add_argument("--top-p", type=float, help="top-p (default 0.9); with top-k both apply")
    generate.add_argument("--beams", type=positive_int, help="beam search (default 4)")
    generate.add_argument("--seed", type=int, help="sampling strategies (default 0)")
    generate.add_argument("--stream", action="store_true", help="print text as it is produced")
    generate.add_argument("--stop", action="append", default=[], metavar="TEXT",
                          help="stop before TEXT (repeatable); the output ends before its first occurrence")

    classify = sub.add_parser("classify", help="label a text with a classifier run, with probabilities")
    classify.add_argument("run", help="run directory of a classifier (qkv train --task classify)")
    classify.add_argument("--text", required=True, help="the text to label")
    classify.add_argument("--json", action="store_true")

    serve = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (completions, chat, embeddings) with "
                                         "continuous batching and a playground page (docs/serve.md)")
    serve.add_argument("run", help="a qkv run directory or a Hugging Face model directory")
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this "
                                                            "machine only)")
    serve.add_argument("--port", type=port_number, default=8000, help="0: any free port (printed)")
    serve.add_argument("--max-batch", type=positive_int, default=16, help="requests decoded together")
    serve.add_argument("--max-queue", type=int, default=64, help="requests that may wait for a row; more get 429")
    serve.add_argument("--max-tokens", type=positive_int, help="the most new tokens one request may ask for "
                                                               "(default: the model's context)")
    serve.add_argument("--api-key", help="require `Authorization: Bearer KEY` on /v1/* (default: the "
                                         "QKV_API_KEY environment variable, else none)")
    serve.add_argument("--name", help="the model's id in the API (default: the directory's name)")
    serve.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ...")
    serve.add_argument("--threads", type=positive_int, help="torch threads of the decoding engine (default on "
                                                            "CPU: 1, measured fastest on 2 cores; docs/serve.md)")

    hf_commands.add_parsers(sub)
    analysis_commands.add_parsers(sub)

    listing = sub.add_parser("presets", help="list the named configurations")
    listing.add_argument("--json", action="store_true")
    return root


def main(argv: list[str] | None = None) -> int:
    warnings.showwarning = show_warning
    try:
        args = parser().parse_args(argv)
        code = COMMANDS[args.command](args) or 0
        try:
            sys.stdout.flush()  # a full disk fails here, inside the error boundary
        except BrokenPipeError:
            raise
        except OSError as exc:
            quiet_stdout()
            return fail(f"cannot write the output: {exc.strerror or exc}")
        return code
    except QkvError as exc:
        return fail(str(exc))
    except KeyboardInterrupt:
        print("qkv: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader went away (`| head`): stop quietly
        quiet_stdout()
        return 0
    except OSError as exc:  # no space, read-only, permission, a missing file: the file and the reason
        where = f"{exc.filename}: " if exc.filename else ""
        return fail(f"{where}{exc.strerror or exc}")
    except RecursionError:
        return fail("input nested too deeply (a JSON file or value hundreds of levels deep)")
    except (UnicodeError, OverflowError) as exc:
        return fail(f"{type(exc).__name__.replace('Error', '').lower()} error: {exc}")


def show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    """A warning as one line `qkv: warning: ...` (not Python's file:line and source format)."""
    if main_rank():
        print(f"qkv: warning: {message}", file=sys.stderr)


def fail(message: str) -> int:
    """One line `qkv: error: ...` (rank 0 alone under torchrun; every rank exits 2)."""
    if main_rank():
        print(f"qkv: error: {message}", file=sys.stderr)
    return 2


def quiet_stdout() -> None:
    """Point stdout at /dev/null, so that the interpreter's last flush does not fail on the closed pipe."""
    try:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    except (OSError, ValueError):
        pass


def main_rank() -> bool:
    """Rank 0 of a torchrun launch, or a single process."""
    return os.environ.get("RANK", "0") == "0"


def cmd_train(args) -> int:
    from qkv.train import job, reference, tasks

    log = (lambda message: print(message, file=sys.stderr)) if main_rank() else (lambda message: None)  # noqa: E731
    if args.resume:
        if not args.out:
            raise QkvError("--resume needs --out RUN_DIR")
        if args.task or args.init:
            raise QkvError("--resume continues a run with its own config; --task and --init start a new one")
        reference.check_engine(args.engine, resume=True, max_time=0.0)
        out = Path(args.out)
        with job.claim(out, resume=True):  # one writer per run dir, from before its config is read
            cfg = job.resume_config(out, args.max_steps, args.max_time, layout=args.set, data=args.data,
                                    config_file=args.config, preset=args.preset)
            return train_into(args, out, cfg, log)
    preset = args.preset or (tasks.TASKS.get(args.task).preset if args.task else "shakespeare")
    cfg = job.resolve_config(preset=preset, config_file=args.config, overrides=args.set, data=args.data,
                             max_steps=args.max_steps, max_time=args.max_time, task=args.task, init=args.init)
    reference.check_engine(args.engine, resume=False, max_time=cfg.train.max_time)
    out = Path(args.out) if args.out else job.default_out(f"{preset}-{args.task}" if args.task else preset)
    with job.claim(out, resume=False):
        return train_into(args, out, cfg, log)


def train_into(args, out: Path, cfg, log) -> int:
    from qkv.models.build import objective_of
    from qkv.train import job, reference

    trainer, cfg = job.start(out, cfg, resume=args.resume, log=log, progress=not args.quiet)
    log(f"qkv: training {sum(p.numel() for p in trainer.model.parameters()):,} parameters into {out} "
        f"(vocab {cfg.model.vocab_size}, {len(trainer.data.train):,} training tokens)")
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


# ---------------------------------------------------------------------------------------- train's report


def summary_line(summary: dict) -> str:
    """The summary as strict JSON: a value that is not finite (a NaN loss) is null, never NaN or Infinity."""
    return strict_json(summary)


def strict_json(value) -> str:
    """JSON that every parser reads: floats that are not finite become null, at any depth."""
    def clean(v):
        if isinstance(v, float) and not math.isfinite(v):
            return None
        if isinstance(v, dict):
            return {key: clean(item) for key, item in v.items()}
        if isinstance(v, (list, tuple)):
            return [clean(item) for item in v]
        return v

    return json.dumps(clean(value), allow_nan=False)


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
    """A short top-p sample from the trained model, starting from the start-of-text token."""
    import torch

    from qkv.generate import generate

    tokenizer = trainer.data.tokenizer
    start_ids = torch.tensor([[tokenizer.eos_id]], device=trainer.device)
    new = min(max_new_tokens, cfg.model.max_seq_len - 1)
    ids = generate(trainer.model, start_ids, max_new_tokens=new, strategy="top-p", top_p=0.9, temperature=0.8,
                   seed=cfg.train.seed, stop_tokens=(tokenizer.eos_id,))
    return "--- sample ---\n" + tokenizer.decode([i for i in ids[0, 1:].tolist() if i != tokenizer.eos_id])


def cmd_eval(args) -> int:
    from qkv.formats import load
    from qkv.evaluate import runs as evaluators

    run = load(args.run)
    result = evaluators.evaluate(run, args.data, args.stride)  # by the run's objective
    print(strict_json(result) if args.json else evaluators.describe(result))
    return 0


def cmd_classify(args) -> int:
    from qkv.formats import load
    from qkv.evaluate.classify import classify_text

    run = load(args.run)
    require_objective(run, "classify", ("classify",))
    probs = classify_text(run, args.text)
    if args.json:
        print(json.dumps(probs))
    else:
        print("\n".join(f"{label:<14} {p:.4f}" for label, p in sorted(probs.items(), key=lambda kv: -kv[1])))
    return 0


# which options each strategy reads (the others are refused: they would change nothing)
STRATEGY_OPTIONS = {"greedy": (), "beam": ("beams",), "sample": ("temperature", "seed"),
                    "top-k": ("temperature", "top_k", "top_p", "seed"), "top-p": ("temperature", "top_k", "top_p", "seed")}
GENERATE_DEFAULTS = {"temperature": 0.8, "top_k": 50, "top_p": 0.9, "beams": 4, "seed": 0}


def generation_settings(args, strategy: str, warn: bool = True) -> tuple[str, dict]:
    """(strategy, settings) for `qkv generate`: an option the strategy does not read is refused (--seed,
    harmless, is warned about); --top-k with --top-p (either strategy) applies both, as transformers does."""
    given = [name for name in GENERATE_DEFAULTS if getattr(args, name) is not None]
    for name in given:
        if name not in STRATEGY_OPTIONS[strategy]:
            flag = "--" + name.replace("_", "-")
            if name == "seed":
                if warn:
                        print(f"qkv: warning: {flag} does not apply to --strategy {strategy} (it draws nothing)",
                          file=sys.stderr)
                continue
            raise QkvError(f"{flag} does not apply to --strategy {strategy}; it reads "
                           f"{', '.join('--' + n.replace('_', '-') for n in STRATEGY_OPTIONS[strategy]) or 'none of them'}")
    settings = {name: GENERATE_DEFAULTS[name] if getattr(args, name) is None else getattr(args, name)
                for name in GENERATE_DEFAULTS}
    if not 0.0 < settings["top_p"] <= 1.0:
        raise QkvError(f"--top-p={settings['top_p']} must be in (0, 1]")
    if not settings["temperature"] > 0:
        raise QkvError(f"--temperature={settings['temperature']} must be positive")
    if strategy in ("top-k", "top-p") and args.top_k is not None and args.top_p is not None:
        strategy = "top-k-top-p"
    return strategy, settings


def cmd_generate(args) -> int:
    from qkv.generate.text import generate_text
    from qkv.formats import load

    if args.strategy is not None:
        generation_settings(args, args.strategy, warn=False)  # bad options fail before the run is loaded
    run = load(args.run)
    objective = require_objective(run, "generate", ("lm", "seq2seq"))
    strategy, settings = generation_settings(args, args.strategy or ("beam" if objective == "seq2seq" else "top-p"))
    text = generate_text(run, args.prompt, max_new_tokens=args.max_new_tokens, strategy=strategy,
                         temperature=settings["temperature"], top_k=settings["top_k"], top_p=settings["top_p"],
                         num_beams=settings["beams"], seed=settings["seed"],
                         stream=sys.stdout if args.stream else None, stop_strings=tuple(args.stop))
    if not args.stream:
        print(text)
    return 0


def require_objective(run, command: str, supported: tuple[str, ...]) -> str:
    from qkv.models.build import objective_of

    objective = objective_of(run.config)
    if objective not in supported:
        raise QkvError(f"qkv {command} supports {' and '.join(supported)} runs; {run.path} is a "
                       f"model.arch={run.config.model.arch!r} run (objective {objective!r})")
    return objective


def cmd_serve(args) -> int:
    from qkv.serve.server import serve

    if args.max_queue < 0:
        raise QkvError(f"--max-queue={args.max_queue} must be >= 0")
    key = args.api_key if args.api_key is not None else os.environ.get("QKV_API_KEY") or None
    if key is not None and not key.strip():
        raise QkvError("--api-key is empty")
    serve(args.run, host=args.host, port=args.port, max_batch=args.max_batch, max_queue=args.max_queue,
          max_tokens=args.max_tokens, api_key=key, name=args.name, device=args.device, threads=args.threads,
          log=lambda message: print(message, file=sys.stderr, flush=True))
    return 0


def cmd_presets(args) -> int:
    from qkv import presets

    rows = [{"name": name, "description": presets.describe(name)} for name in presets.PRESETS.names()]
    if args.json:
        print(json.dumps(rows))
    else:
        print("\n".join(f"{row['name']:<14} {row['description']}" for row in rows))
    return 0


COMMANDS = {"train": cmd_train, "eval": cmd_eval, "generate": cmd_generate, "presets": cmd_presets,
            "classify": cmd_classify, "serve": cmd_serve,
            "convert": hf_commands.cmd_convert, **analysis_commands.COMMANDS}
