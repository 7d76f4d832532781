"""`qkv generate`: a prompt continued by a run, with the decoding strategy's own options only."""
from __future__ import annotations

import sys

from qkv.cli.options import (add_compile, add_kv_dtype, add_precision, apply_compile, apply_precision, load_for_inference,
                             positive_int)
from qkv.errors import QkvError


STRATEGIES = ("greedy", "sample", "top-k", "top-p", "beam")

def add_parsers(sub) -> None:
    generate = sub.add_parser("generate", help="continue a prompt with a trained run")
    generate.add_argument("run", help="run directory")
    generate.add_argument("--prompt", default="", help="text to continue (default: none; the model then continues "
                                                           "end-of-text and a line break, which is not printed)")
    generate.add_argument("--max-new-tokens", type=positive_int, default=200)
    generate.add_argument("--strategy", choices=STRATEGIES,
                          help="default: top-p for a language model, beam for an encoder-decoder")
    generate.add_argument("--temperature", type=float, help="sampling strategies (default 0.8)")
    generate.add_argument("--top-k", type=positive_int, help="top-k (default 50); with top-p both apply")
    generate.add_argument("--top-p", type=float, help="top-p (default 0.9); with top-k both apply")
    generate.add_argument("--beams", type=positive_int, help="beam search (default 4)")
    generate.add_argument("--seed", type=int, help="sampling strategies (default 0)")
    generate.add_argument("--stream", action="store_true", help="print text as it is produced")
    add_precision(generate)
    add_kv_dtype(generate)
    add_compile(generate)
    generate.add_argument("--steer", action="append", default=[], metavar="FILE@LAYER:SCALE",
                          help="add SCALE x the vector in FILE (qkv probe --minus ... --out FILE) to the residual "
                               "stream leaving block LAYER, at every position and step; repeatable")
    generate.add_argument("--stop", action="append", default=[], metavar="TEXT",
                          help="stop before TEXT (repeatable); the output ends before its first occurrence")


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
    from qkv.nn.hookpoints import hooked

    if args.strategy is not None:
        generation_settings(args, args.strategy, warn=False)  # bad options fail before the run is loaded
    run = load_for_inference(args)
    objective = require_objective(run, "generate", ("lm", "seq2seq"))
    apply_precision(run, args)
    apply_compile(run, args)
    strategy, settings = generation_settings(args, args.strategy or ("beam" if objective == "seq2seq" else "top-p"))
    with hooked(run.model, [steering(spec, run.model) for spec in args.steer]):
        text = generate_text(run, args.prompt, max_new_tokens=args.max_new_tokens, strategy=strategy,
                             temperature=settings["temperature"], top_k=settings["top_k"], top_p=settings["top_p"],
                             num_beams=settings["beams"], seed=settings["seed"],
                             stream=sys.stdout if args.stream else None, stop_strings=tuple(args.stop))
    if not args.stream:
        print(text)
    return 0


def steering(spec: str, model):
    """FILE@LAYER:SCALE -> the hook (name, fn) that adds SCALE x FILE's vector to blocks.LAYER.resid_post."""
    import math

    from safetensors import SafetensorError
    from safetensors.torch import load_file

    from qkv.interp import steer

    path, _, rest = spec.rpartition("@")
    layer, _, scale = rest.partition(":")
    try:
        layer, scale = int(layer), float(scale or 1.0)
    except ValueError:
        raise QkvError(f"--steer {spec!r}: expected FILE@LAYER:SCALE (a block number and a number)") from None
    if not math.isfinite(scale):
        raise QkvError(f"--steer {spec!r}: SCALE must be a finite number")
    if not path:
        raise QkvError(f"--steer {spec!r}: expected FILE@LAYER:SCALE")
    blocks = getattr(model, "blocks", None)
    if blocks is None or not 0 <= layer < len(blocks):
        raise QkvError(f"--steer {spec!r}: block {layer} is not in this model")
    try:
        vector = load_file(path).get("vector")
    except (OSError, SafetensorError) as exc:
        raise QkvError(f"--steer {path}: {exc}") from None
    width = model.blocks[layer].attn.o_proj.out_features
    if vector is None or tuple(vector.shape) != (width,) or not vector.is_floating_point():
        raise QkvError(f"--steer {path}: needs one tensor 'vector' of shape ({width},) (qkv probe --minus writes it)")
    return f"blocks.{layer}.resid_post", steer(vector, scale)


def require_objective(run, command: str, supported: tuple[str, ...]) -> str:
    from qkv.models.build import use_of

    objective = use_of(run.config)
    if objective not in supported:
        raise QkvError(f"qkv {command} supports {' and '.join(supported)} runs; {run.path} is a "
                       f"model.arch={run.config.model.arch!r} run (objective {objective!r})")
    return objective


COMMANDS = {"generate": cmd_generate}
