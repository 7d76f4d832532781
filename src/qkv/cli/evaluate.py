"""`qkv eval` (each objective's held-out figures) and `qkv classify` (a classifier's labels for a text)."""
from __future__ import annotations

import json

from qkv.cli.generate import require_objective
from qkv.errors import QkvError
from qkv.cli.options import add_precision, apply_precision, load_for_inference, positive_int, strict_json


def add_parsers(sub) -> None:
    evaluate = sub.add_parser("eval", help="held-out figures of a run: loss, perplexity and bits per character "
                                           "(LM), masked-token accuracy (MLM), accuracy (classifier)")
    evaluate.add_argument("run", help="run directory")
    evaluate.add_argument("--data", action="append", default=[], metavar="PATH",
                          help="score this text instead of the run's validation split")
    evaluate.add_argument("--task", metavar="FILE.jsonl", help="multiple choice by log-likelihood: rows of "
                          "{\"context\", \"choices\", \"gold\"}, or shakespeare-cloze (which of four lines comes "
                          "next in a held-out play); accuracy, length-normalised accuracy, standard errors (as "
                          "lm-evaluation-harness scores them)")
    evaluate.add_argument("--stride", type=positive_int, help="sliding-window stride (default: context / 2)")
    evaluate.add_argument("--json", action="store_true")
    add_precision(evaluate)

    classify = sub.add_parser("classify", help="label a text with a classifier run, with probabilities")
    classify.add_argument("run", help="run directory of a classifier (qkv train --task classify)")
    classify.add_argument("--text", required=True, help="the text to label")
    classify.add_argument("--json", action="store_true")


def cmd_eval(args) -> int:
    from qkv.evaluate import runs as evaluators

    if args.task and (args.data or args.stride):
        raise QkvError("--task scores its own rows; --data and --stride apply to scoring a text")
    run = load_for_inference(args)
    precision = apply_precision(run, args)
    if args.task:
        from qkv.evaluate.choice import evaluate_task

        require_objective(run, "eval --task", ("lm",))
        result = evaluate_task(run, args.task)
    else:
        result = evaluators.evaluate(run, args.data, args.stride)  # by the run's objective
    result["precision"] = precision or "fp32 weights"
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


COMMANDS = {"eval": cmd_eval, "classify": cmd_classify}
