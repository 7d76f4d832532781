"""`qkv convert`: models between the file formats qkv reads (qkv.formats); its options beside its handler,
qkv.formats loading when the command runs.

    qkv convert --from-hf DIR --out RUN      a run dir that qkv generate / eval / train --resume read
    qkv convert --from-gguf F.gguf --out RUN a run dir from a GGUF file (its tokenizer and chat template kept)
    qkv convert RUN --to-hf DIR              a dir transformers' from_pretrained loads (RUN: any format qkv reads)
    qkv convert RUN --to-gguf F.gguf [--dtype f32|f16|bf16|q8_0|q4_0]   a file llama.cpp and Ollama run
    qkv convert RUN --merge-lora --out RUN2  a LoRA run (or RUN with --adapter PATH) with its adapters folded in
    qkv convert MODEL --adapter A.gguf --to-peft DIR   an adapter (a GGUF one, a LoRA run's) as a PEFT dir

A LoRA adapter is a LoRA run's own, or --adapter PATH (a PEFT dir or a GGUF adapter file) over RUN. With one,
--to-gguf writes the adapter alone as a GGUF adapter (llama.cpp applies it over the base file at run time:
`llama-cli -m BASE.gguf --lora ADAPTER.gguf`), and --merge-lora --to-gguf the merged model; --to-hf and --out
write the merged model (a Hugging Face dir holds a whole model; the adapter in PEFT's format is the LoRA run
dir itself, or the --adapter dir)."""
from __future__ import annotations

import json
import sys

from qkv.errors import QkvError


def add_parsers(subparsers) -> None:
    convert = subparsers.add_parser("convert", help="checkpoints in and out: Hugging Face dirs (GPT-2, LLaMA, BERT, "
                                                    "BART, T5) and GGUF files in")
    convert.add_argument("run", nargs="?", help="the model to export (with --to-hf): a run dir, HF dir or GGUF file")
    convert.add_argument("--to-hf", metavar="DIR", help="write RUN as a Hugging Face model dir")
    convert.add_argument("--from-hf", metavar="DIR", help="read a Hugging Face model dir (config.json + "
                                                          "model.safetensors [+ tokenizer.json])")
    convert.add_argument("--from-gguf", metavar="FILE", help="read a GGUF file (llama.cpp's format)")
    convert.add_argument("--to-gguf", metavar="FILE", help="write RUN as a GGUF file (llama- or gpt2-shaped models); "
                         "a LoRA run, or RUN with --adapter: the adapter alone, as llama.cpp's --lora reads it")
    convert.add_argument("--to-peft", metavar="DIR", help="write the adapter (a LoRA run's, or --adapter's, e.g. a GGUF "
                         "adapter file) as a PEFT dir, which peft.PeftModel.from_pretrained loads over the base")
    convert.add_argument("--dtype", choices=("f32", "f16", "bf16", "q8_0", "q4_0"),
                         help="with --to-gguf: the matrices' type (default f32; an adapter's: f32, f16 or bf16)")
    convert.add_argument("--quant", choices=("int8", "int4"),
                         help="with --from-hf / --from-gguf: save the linear layers' weights quantized (int8 per row, "
                              "or 4 bits per group of 32; a Q4_1 file's own weights), loaded later as saved")
    convert.add_argument("--out", metavar="RUN", help="the qkv run directory to create (with --from-hf or "
                                                      "--from-gguf)")
    convert.add_argument("--merge-lora", action="store_true", help="with RUN and --out, --to-hf or --to-gguf: write "
                         "RUN (a LoRA run, or any model with --adapter) as a whole model, W + s B A in each adapted "
                         "layer")
    convert.add_argument("--adapter", metavar="PATH", help="a LoRA adapter over RUN: a PEFT dir or a GGUF adapter "
                                                          "file (merged into the model, or with --to-gguf written "
                                                          "alone)")
    convert.add_argument("--json", action="store_true", help="print what was written as JSON")


def cmd_convert(args) -> int:
    from qkv.formats import gguf, hf, load, merge_adapter, run_dir
    from qkv.nn.quant import quantization_of, quantize_model

    sources = [name for name in ("from_hf", "from_gguf") if getattr(args, name)]
    what = ""  # what the file is, where that is not plain
    targets = [name for name in ("to_hf", "to_gguf") if getattr(args, name)]
    if args.dtype and not args.to_gguf:
        raise QkvError("--dtype applies to --to-gguf")
    if args.quant and not sources:
        raise QkvError("--quant applies to --from-hf / --from-gguf (a run dir with quantized weights)")
    if args.to_peft:
        if sources or targets or args.out or args.merge_lora or not args.run:
            raise QkvError("--to-peft takes RUN (a LoRA run) or MODEL --adapter PATH, and no other target")
        if not (is_lora_run(args.run) or args.adapter):
            raise QkvError(f"{args.run}: has no LoRA adapters (not a run trained with --lora); give --adapter PATH")
        out = write_peft(args.run, args.adapter or args.run, args.to_peft)
        print(json.dumps({"from": args.adapter or args.run, "to": str(out)}) if args.json else
              f"qkv: wrote {out}: a PEFT adapter (peft.PeftModel.from_pretrained(base, \"{out}\"); qkv: --adapter {out})")
        return 0
    if args.merge_lora and (sources or not args.run or not (args.out or targets)):
        raise QkvError("--merge-lora takes RUN and one of --out RUN2, --to-hf DIR, --to-gguf FILE")
    if args.merge_lora and args.out and not targets:
        source, out = args.run, merge_into(args.run, args.out, args.adapter)
    elif len(sources) == 1 and not targets and not args.run:
        flag = "--" + sources[0].replace("_", "-")
        if not args.out:
            raise QkvError(f"convert {flag} needs --out RUN")
        source = getattr(args, sources[0])
        if args.from_hf:
            if args.adapter:
                raise QkvError("--adapter with --from-hf: convert the dir first, then merge into the run with "
                               "RUN --merge-lora --adapter PATH --out RUN2")
            out = hf.convert_from_hf(source, args.out, args.quant or "none")
        else:
            run = gguf.load(source)
            if args.adapter:
                print(merge_adapter(run, args.adapter), file=sys.stderr)
            if args.quant:
                quantize_model(run.model, args.quant)
            out = run_dir.save(run, args.out)
    elif len(targets) == 1 and args.run and not sources and not args.out:
        source = args.run
        lora_run = is_lora_run(args.run)
        if lora_run and args.adapter:
            raise QkvError(f"{args.run}: a LoRA run holds its own adapter; --adapter would put a second one over it "
                           "(merge the run first: RUN --merge-lora --out RUN2)")
        if args.merge_lora and not (lora_run or args.adapter):
            raise QkvError(f"{args.run}: has no LoRA adapters (not a run trained with --lora); give --adapter PATH")
        if args.to_gguf and (lora_run or args.adapter) and not args.merge_lora:
            out = write_gguf_adapter(args.run, args.adapter or args.run, args.to_gguf, args.dtype or "f32")
            what = (f": a LoRA adapter over {args.run}'s base model (llama.cpp: -m BASE.gguf --lora {out}; qkv: "
                    f"--adapter {out}); --merge-lora writes the merged model instead")
        else:
            run = load(args.run)
            if args.adapter:
                print(merge_adapter(run, args.adapter), file=sys.stderr)
            held = quantization_of(run.model)
            if held != "none":
                raise QkvError(f"{args.run}: holds {held} weights (qkv convert --quant); export the model it was "
                               "converted from instead")
            out = hf.save(run, args.to_hf) if args.to_hf else gguf.save(run, args.to_gguf, args.dtype or "f32")
    else:
        raise QkvError("convert takes one of --from-hf DIR --out RUN, --from-gguf FILE --out RUN, RUN --to-hf DIR "
                       "and RUN --to-gguf FILE")
    if args.json:
        print(json.dumps({"from": str(source), "to": str(out)}))
    else:
        print(f"qkv: wrote {out}{what}")
    return 0


def is_lora_run(source: str) -> bool:
    """A qkv run dir trained with --lora (its adapter beside its checkpoint, merged when it loads)."""
    from pathlib import Path

    from qkv.config import RunConfig
    from qkv.files import CONFIG_FILE
    from qkv.formats import hf

    path = Path(source)
    return (path.is_dir() and (path / CONFIG_FILE).is_file() and not hf.is_hf_dir(path)
            and bool(RunConfig.load(path / CONFIG_FILE).train.lora))


def merge_into(source: str, out: str, adapter: str | None):
    """A LoRA run (merged when it loads) or any model plus an adapter, written as a plain run dir."""
    from qkv.formats import load, merge_adapter, run_dir

    if not is_lora_run(source) and not adapter:
        raise QkvError(f"{source}: has no LoRA adapters (not a run trained with --lora); give --adapter PATH")
    run = load(source)
    if adapter:
        print(merge_adapter(run, adapter), file=sys.stderr)
    return run_dir.save(run, out)


def write_peft(base: str, adapter: str, out: str):
    """The adapter at `adapter` (a GGUF adapter, a PEFT dir, a LoRA run) for the model `base`, as a new PEFT dir."""
    from pathlib import Path

    from qkv.formats import load_config, peft, read_adapter

    if Path(out).exists() and (not Path(out).is_dir() or any(Path(out).iterdir())):
        raise QkvError(f"--to-peft {out}: exists and is not an empty directory; choose another")
    cfg = load_config(base).model
    return peft.write_adapter(read_adapter(adapter, cfg, base), cfg, out)


def write_gguf_adapter(base: str, adapter: str, out: str, dtype: str):
    """The adapter at `adapter` (a PEFT dir, a LoRA run, a GGUF adapter) for the model `base`, as a GGUF adapter."""
    from pathlib import Path

    from qkv.formats import load_config, read_adapter
    from qkv.formats.gguf.adapter import base_file_arch, save_adapter

    cfg = load_config(base).model
    return save_adapter(read_adapter(adapter, cfg, base), cfg, out, dtype, name=Path(adapter).name,
                        base=base_file_arch(base))


COMMANDS = {"convert": cmd_convert}
