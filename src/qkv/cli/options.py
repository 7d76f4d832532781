"""What every command group of the CLI shares: the parser whose errors are one line, the types of option
values, strict JSON output, and the rank that reports under torchrun."""
from __future__ import annotations

import argparse
import json
import math
import os
import sys

from qkv.errors import QkvError


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


def main_rank() -> bool:
    """Rank 0 of a torchrun launch, or a single process."""
    return os.environ.get("RANK", "0") == "0"


def number(text: str) -> float:
    """A float that may be written 3e23 or 300e9; must be positive."""
    try:
        value = float(text)
    except ValueError:
        raise QkvError(f"{text!r} is not a number") from None
    if not value > 0 or not math.isfinite(value):
        raise QkvError(f"{text!r} must be a positive number")
    return value


def count(text: str) -> int:
    value = number(text)
    if value != int(value):
        raise QkvError(f"{text!r} must be a whole number")
    return int(value)


def config_options(parser, preset_default: str | None) -> None:
    parser.add_argument("--preset", default=preset_default, help="named configuration (see `qkv presets`)")
    parser.add_argument("--config", help="JSON file with sections model, train, data, parallel")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                        help="override one field, e.g. --set model.n_kv_heads=2 (repeatable)")


def add_precision(parser) -> None:
    """--dtype and --quant: the precision a loaded model runs at (qkv.generate.weights)."""
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32",
                        help="activations and unquantized weights (default fp32; bf16 where the CPU has it natively)")
    parser.add_argument("--quant", choices=("none", "int8", "int4"),
                        help="the linear layers' weights: int8 per row, or 4 bits per group of 32 (GGUF's Q4_1; "
                             "the head above 4 bits); CPU only; none: unquantized (a GGUF file dequantized). Default: "
                             "a GGUF file's quantized blocks (Q4_0-Q8_0, Q4_K-Q6_K) as shipped, other weights as "
                             "they are"),
    parser.add_argument("--adapter", metavar="PATH", help="a LoRA adapter merged into the model first: a PEFT dir "
                        "(adapter_config.json + adapter_model.safetensors; a LoRA run) or a GGUF adapter file "
                        "(llama.cpp's --lora)")


def add_kv_dtype(parser) -> None:
    """--kv-dtype: the dtype a decoder's KV cache holds (qkv.generate.weights.set_kv_dtype)."""
    parser.add_argument("--kv-dtype", choices=("fp32", "bf16", "fp16"),
                        help="keys and values in the KV cache (default: the model's dtype; fp16 or bf16 halve what "
                             "a step reads from a long cache, as llama.cpp's default fp16 cache; faster with "
                             "--compile, slower without)")


COMPILE_OFF = ("0", "off", "no", "false")  # QKV_COMPILE values that turn the default compiled step off


def add_compile(parser) -> None:
    """--compile / --no-compile: how the decoding step is compiled (qkv.generate.compiled); by default in the
    background, unless QKV_COMPILE=0."""
    choice = parser.add_mutually_exclusive_group()
    choice.add_argument("--compile", dest="compile", action="store_const", const="now",
                        help="compile the whole token step with torch.compile before the first token (by default "
                             "it compiles in the background at the lowest CPU priority while decoding starts "
                             "without it, and takes over when ready: SmolLM2 int4 about 2x faster a token; "
                             "1.5-6 minutes on 2 cores the first time, inductor's cache later)")
    choice.add_argument("--no-compile", dest="compile", action="store_const", const="off",
                        help="decode without the compiled step (also QKV_COMPILE=0)")


def compile_mode(args) -> str:
    """'now' (--compile), 'off' (--no-compile, or QKV_COMPILE=0 without a flag) or 'background' (the default)."""
    chosen = getattr(args, "compile", None)
    if chosen is not None:
        return chosen
    return "off" if os.environ.get("QKV_COMPILE", "").strip().lower() in COMPILE_OFF else "background"


def apply_compile(run, args, warm: bool = False, automatic: bool = True) -> None:
    """Attach the compiled step to run.model as compile_mode(args) says. --compile: now, or say in one line why
    it does not apply; `warm`: the token step and a short prompt's prefill compiled before returning (a chat:
    before its first turn, not in the middle of one). The default: compiled in the background where it applies
    on the CPU (else the model decodes eagerly, silently), taking over when ready (`automatic`) or at
    background.take_over() (a chat: between turns), saying so in one line."""
    mode = compile_mode(args)
    if mode == "off":
        return
    from qkv.generate import background, compiled

    if mode == "background":
        if getattr(args, "steer", None) or next(run.model.parameters()).device.type != "cpu":
            return
        try:
            background.enable_in_background(run.model, announce=lambda line: print(line, file=sys.stderr, flush=True),
                                          automatic=automatic)
        except ValueError:
            pass  # (the general step: not every model has a compiled one)
        return
    if getattr(args, "steer", None):
        raise QkvError("--compile does not apply with --steer: the steering hooks must see their layers run")
    try:
        compiled.enable(run.model)
    except ValueError as exc:
        raise QkvError(f"--compile: {exc}") from None
    cost = "1-2 minutes each on 2 cores the first time; later starts read inductor's cache: about 10 s each"
    if not warm:
        print(f"qkv: --compile: the first token step compiles, and the first short prompt (2-16 tokens) its own "
              f"graph ({cost})", file=sys.stderr, flush=True)
        return
    print(f"qkv: --compile: compiling the token step and a short prompt's prefill before the first turn ({cost})",
          file=sys.stderr, flush=True)
    seconds = background.warm_up(run.model, rows=(1,), prompt=True)
    if compiled.compiled_step(run.model).failed is None:  # (else its one warning said why it decodes eagerly)
        print(f"qkv: --compile: ready ({seconds:.0f} s)", file=sys.stderr, flush=True)


def load_for_inference(args):
    """args.run read for inference at --dtype / --quant (qkv.generate.weights.load: a GGUF file converted a
    block at a time); apply_precision does the rest. An --adapter is merged into the fp32 weights first."""
    from qkv.generate import weights

    return weights.load(args.run, dtype=args.dtype, quant=args.quant, stream=not getattr(args, "adapter", None))


def apply_precision(run, args, log=None) -> str | None:
    """Put run.model in --dtype / --quant; warnings and, when not the default, what it runs at go to `log`
    (stderr). Returns the description (None for fp32 unquantized)."""
    import sys

    from qkv.generate import weights

    log = log or (lambda message: print(message, file=sys.stderr, flush=True))
    if getattr(args, "adapter", None):
        from qkv.formats import merge_adapter

        log(merge_adapter(run, args.adapter))
    device = next(run.model.parameters()).device
    for warning in weights.check(args.dtype, args.quant, device, compiled=compile_mode(args) != "off"):
        log(warning)
    description = weights.prepare(run.model, dtype=args.dtype, quant=args.quant)  # fuses Q/K/V and gate/up too
    kv = weights.set_kv_dtype(run.model, getattr(args, "kv_dtype", None))  # (generate, chat and serve take it)
    if kv:
        log(kv)
    if description == "fp32 weights":  # (the default on an unquantized model: nothing to say)
        return None
    log(f"qkv: running at {description}")
    return description
