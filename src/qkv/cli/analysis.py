"""The analysis commands (SPEC F1-F4): `qkv calc`, `qkv scaling`, `qkv explain` and `qkv verify`. Bad input
raises QkvError (exit 2, one line)."""
from __future__ import annotations

import json
from pathlib import Path

from qkv.analysis import report
from qkv.cli.options import add_precision, config_options, count, number
from qkv.errors import QkvError


def add_parsers(sub) -> None:
    """Add `calc`, `scaling`, `explain` and `verify` to the `qkv` sub-parsers."""
    calc = sub.add_parser("calc", help="parameters, FLOPs, training memory, KV cache and MFU of a config or a model")
    calc.add_argument("run", nargs="?", help="a model's file instead of a config: a run dir, HF dir or GGUF file")
    config_options(calc, None)
    calc.add_argument("--seq", type=count, help="tokens per sequence (default train.seq_len)")
    calc.add_argument("--batch", type=count, help="sequences per GPU per micro-batch (default: the config's)")
    calc.add_argument("--precision", choices=("fp32", "bf16", "fp16"), help="default train.precision")
    calc.add_argument("--optimizer", choices=("adamw", "adam", "sgd", "muon"), help="default train.optimizer")
    calc.add_argument("--zero", type=int, choices=(0, 1, 2, 3), help="ZeRO stage (default parallel.zero)")
    calc.add_argument("--gpus", type=count, help="data-parallel GPUs (default parallel.dp)")
    calc.add_argument("--tp", type=count, help="tensor-parallel ranks (default parallel.tp)")
    calc.add_argument("--pp", type=count, help="pipeline stages (default parallel.pp)")
    calc.add_argument("--ep", type=count, help="expert-parallel ranks among the --gpus (default parallel.ep)")
    calc.add_argument("--microbatches", type=count, help="pipeline micro-batches per step (default "
                      "parallel.microbatches; --batch is one micro-batch)")
    calc.add_argument("--schedule", help="pipeline schedule, a name of parallel.schedule (default: the config's)")
    calc.add_argument("--layout", choices=("qkv", "textbook"),
                      help="mixed-precision layout: qkv's fp32 weights and gradients under autocast (default), "
                           "or low-precision weights and gradients with an fp32 master copy")
    calc.add_argument("--checkpointing", action="store_true", help="activation checkpointing per layer")
    calc.add_argument("--tokens", type=number, help="training tokens D: report 6ND and the exact count")
    calc.add_argument("--step-time", type=number, help="measured seconds per optimizer step: report MFU")
    calc.add_argument("--peak-flops", type=number, help="the hardware's peak FLOP/s for MFU (e.g. 312e12)")
    calc.add_argument("--json", action="store_true")

    scaling = sub.add_parser("scaling", help="fit L = a / N^b + c to runs; Chinchilla split of a budget")
    scaling.add_argument("runs", nargs="*", help="run directories (3 or more for --x params)")
    scaling.add_argument("--x", choices=("params", "tokens"), default="params",
                         help="params: final validation loss per run vs non-embedding parameters; "
                              "tokens: each run's loss curve vs tokens seen (note 000 LLM §8.2)")
    scaling.add_argument("--budget", type=number, help="training FLOPs C: the compute-optimal N and D")
    scaling.add_argument("--fit", choices=("hoffmann", "besiroglu"), default="hoffmann",
                         help="Chinchilla parametric fit (default: Hoffmann et al. 2022 as published)")
    scaling.add_argument("--out", default="scaling.png", help="plot of the fit")
    scaling.add_argument("--json", action="store_true")

    explain = sub.add_parser("explain", help="one self-contained HTML page: the forward and backward passes of a "
                             "run on a text, step by step, with the notes' formulas and the real numbers")
    explain.add_argument("run", help="a qkv run directory or an imported Hugging Face model directory")
    explain.add_argument("--text", required=True, help="the text to run through the model")
    explain.add_argument("--target", help="the token whose loss the backward explains (default: the model's top "
                         "choice; a classifier: a label)")
    explain.add_argument("--out", default="explain.html", help="the page to write (default explain.html)")
    explain.add_argument("--compare", metavar="RUN2", help="a second run, shown side by side on the same text")
    explain.add_argument("--corrupt", metavar="TEXT", help="a decoder: activation patching against this text (as "
                         "many tokens as --text), shown in the page's inside steps")
    add_precision(explain)

    verify = sub.add_parser("verify", help="compute every SPEC claim: holds, corrected or fails")
    verify.add_argument("--claim", type=int, action="append", help="only claim N (repeatable)")
    verify.add_argument("--json", action="store_true")


def cmd_calc(args) -> int:
    from qkv.analysis import calc

    if args.run is not None:
        if args.preset or args.config or args.set:
            raise QkvError("calc takes a model's file or a config (--preset, --config, --set), not both")
        from qkv.formats import load_config

        cfg = load_config(args.run)  # the model as its file has it, its weights unread (a config.json alone will do)
    else:
        cfg = calc.resolve(args.preset, args.config, args.set)
    result = calc.calculate(cfg, seq=args.seq, batch=args.batch, precision=args.precision,
                            optimizer=args.optimizer, zero=args.zero, gpus=args.gpus, tp=args.tp, pp=args.pp, ep=args.ep,
                            microbatches=args.microbatches, schedule=args.schedule, layout=args.layout,
                            checkpointing=args.checkpointing, tokens=args.tokens,
                            step_time=args.step_time, peak_flops=args.peak_flops)
    print(json.dumps(result) if args.json else report.calc_text(result))
    return 0


def cmd_scaling(args) -> int:
    from qkv.analysis import scaling

    if not args.runs and args.budget is None:
        raise QkvError("scaling: give run directories to fit, --budget FLOPS for the Chinchilla split, or both")
    result = scaling.analyse([Path(r) for r in args.runs], x=args.x, budget=args.budget, fit=args.fit,
                                  out=Path(args.out))
    print(json.dumps(result) if args.json else report.scaling_text(result))
    return 0


def cmd_explain(args) -> int:
    from qkv.explain import explain_page

    runs = [args.run] + ([args.compare] if args.compare else [])
    path, size = explain_page(runs, args.text, target=args.target, out=args.out, dtype=args.dtype, quant=args.quant or "none",
                              corrupt=args.corrupt, adapter=args.adapter)
    print(f"{path} ({size / 2 ** 20:.2f} MB)")
    return 0


def cmd_verify(args) -> int:
    from qkv.claims import verify

    results = verify.run(args.claim)
    print(json.dumps(results) if args.json else verify.table(results))
    return 0 if all(r["status"] != "fails" for r in results) else 1


COMMANDS = {"explain": cmd_explain, "calc": cmd_calc, "scaling": cmd_scaling, "verify": cmd_verify}
