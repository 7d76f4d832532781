"""`qkv convert`: Hugging Face model dir <-> qkv run dir (its options beside
its handler; qkv.formats loads when the command runs).

    qkv convert --from-hf DIR --out RUN      a run dir that qkv generate / eval / train --resume read
    qkv convert RUN --to-hf DIR              a dir transformers' from_pretrained loads (RUN may be an HF dir)"""
from __future__ import annotations

import json

from qkv.errors import QkvError


def add_parsers(subparsers) -> None:
    convert = subparsers.add_parser("convert", help="Hugging Face checkpoints in and out (GPT-2, LLaMA, BERT, "
                                                    "BART, T5)")
    convert.add_argument("run", nargs="?", help="qkv run directory to export (with --to-hf)")
    convert.add_argument("--to-hf", metavar="DIR", help="write RUN as a Hugging Face model dir")
    convert.add_argument("--from-hf", metavar="DIR", help="read a Hugging Face model dir (config.json + "
                                                          "model.safetensors [+ tokenizer.json])")
    convert.add_argument("--out", metavar="RUN", help="the qkv run directory to create (with --from-hf)")
    convert.add_argument("--json", action="store_true", help="print what was written as JSON")


def cmd_convert(args) -> int:
    from qkv.formats import hf
    from qkv.formats import load

    if args.from_hf and not args.to_hf and not args.run:
        if not args.out:
            raise QkvError("convert --from-hf DIR needs --out RUN")
        out = hf.convert_from_hf(args.from_hf, args.out)
        source = args.from_hf
    elif args.to_hf and args.run and not args.from_hf and not args.out:
        out = hf.save(load(args.run), args.to_hf)
        source = args.run
    else:
        raise QkvError("convert takes either --from-hf DIR --out RUN or RUN --to-hf DIR")
    if args.json:
        print(json.dumps({"from": str(source), "to": str(out)}))
    else:
        print(f"qkv: wrote {out}")
    return 0


COMMANDS = {"convert": cmd_convert}
