"""`qkv chat RUN`: talk to a model in its own chat template, the reply streamed as it is decoded.

At a terminal: a prompt `> `, one message per line, `/reset` (a new conversation, the system message kept)
and `/quit` (or end of input). With stdin not a terminal, each line is one message and each reply is
printed after it, so a conversation can be scripted. A model without a chat template gets qkv's plain default
(qkv.formats.chat.DEFAULT_TEMPLATE).
"""
from __future__ import annotations

import sys

from qkv.cli.generate import GENERATE_DEFAULTS, generation_settings
from qkv.cli.options import (add_compile, add_kv_dtype, add_precision, apply_compile, apply_precision, load_for_inference,
                             positive_int)
from qkv.errors import QkvError


def add_parsers(sub) -> None:
    chat = sub.add_parser("chat", help="talk to a model in its chat template (a GGUF file, an HF dir or a run)")
    chat.add_argument("run", help="a GGUF file, a Hugging Face model dir or a qkv run dir")
    chat.add_argument("--system", help="the system message of the conversation")
    chat.add_argument("--max-new-tokens", type=positive_int, default=512, help="the longest reply (default 512)")
    chat.add_argument("--strategy", choices=("greedy", "sample", "top-k", "top-p"), default="top-p")
    chat.add_argument("--temperature", type=float, help=f"sampling (default {GENERATE_DEFAULTS['temperature']})")
    chat.add_argument("--top-k", type=positive_int, help=f"top-k (default {GENERATE_DEFAULTS['top_k']})")
    chat.add_argument("--top-p", type=float, help=f"top-p (default {GENERATE_DEFAULTS['top_p']})")
    add_precision(chat)
    add_kv_dtype(chat)
    add_compile(chat)
    chat.add_argument("--seed", type=int, help="sampling strategies (default: a fresh seed)")
    chat.set_defaults(beams=None)  # no beam search: a chat streams its reply


def cmd_chat(args) -> int:
    from qkv.generate import background
    from qkv.generate.chat import ChatSession
    from qkv.generate.sampling import SamplingParams
    from qkv.models.build import architecture_of
    from qkv.formats.chat import template_for

    strategy, settings = generation_settings(args, args.strategy, warn=False)
    run = load_for_inference(args)
    if architecture_of(run.model).prompt != "continue" or run.tokenizer is None:
        raise QkvError(f"{args.run}: qkv chat needs a decoder-only language model with a tokenizer")
    apply_precision(run, args)
    apply_compile(run, args, warm=True, automatic=False)  # (--compile: both graphs before the first turn; by
    # default in the background, taking over between turns: never in the middle of a streamed reply)
    params = SamplingParams(temperature=settings["temperature"], top_k=settings["top_k"], top_p=settings["top_p"])
    session = ChatSession(run, template_for(run.chat, run.tokenizer), system=args.system, strategy=strategy,
                          params=params, seed=args.seed, max_new_tokens=args.max_new_tokens)
    interactive = sys.stdin.isatty()
    if interactive:
        print(f"qkv chat: {args.run} ({'its own chat template' if run.chat.template else 'the plain default template'}"
              "); /reset starts again, /quit ends", file=sys.stderr)
    while True:
        try:
            line = input("> ") if interactive else sys.stdin.readline()
        except EOFError:
            break
        if not interactive and not line:
            break
        message = line.rstrip("\n")
        if message.strip() == "/quit":
            break
        if message.strip() == "/reset":
            session.reset()
            continue
        if not message.strip():
            continue
        background.take_over(run.model)  # (where compiled in the background and ready: says so in one line)
        try:
            session.say(message, on_text=lambda piece: print(piece, end="", flush=True))
        except ValueError as exc:  # the model's chat template refused the conversation
            raise QkvError(str(exc)) from None
        print(flush=True)
    return 0


COMMANDS = {"chat": cmd_chat}
