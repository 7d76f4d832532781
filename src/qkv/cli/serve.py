"""`qkv serve`: the OpenAI-compatible server of a run (docs/serve.md)."""
from __future__ import annotations

import os
import sys

from qkv.cli.options import add_compile, compile_mode, add_kv_dtype, add_precision, port_number, positive_int
from qkv.errors import QkvError


def add_parsers(sub) -> None:
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
    add_precision(serve)
    add_kv_dtype(serve)
    add_compile(serve)
    serve.add_argument("--threads", type=positive_int, help="torch threads of the decoding engine, which runs "
                                                            "on the main thread (default: torch's, the cores)")


def cmd_serve(args) -> int:
    from qkv.serve.server import serve

    if args.max_queue < 0:
        raise QkvError(f"--max-queue={args.max_queue} must be >= 0")
    key = args.api_key if args.api_key is not None else os.environ.get("QKV_API_KEY") or None
    if key is not None and not key.strip():
        raise QkvError("--api-key is empty")
    serve(args.run, host=args.host, port=args.port, max_batch=args.max_batch, max_queue=args.max_queue,
          max_tokens=args.max_tokens, api_key=key, name=args.name, device=args.device, threads=args.threads,
          dtype=args.dtype, quant=args.quant, compile=compile_mode(args), kv_dtype=args.kv_dtype,
          adapter=args.adapter,
          log=lambda message: print(message, file=sys.stderr, flush=True))
    return 0


COMMANDS = {"serve": cmd_serve}
