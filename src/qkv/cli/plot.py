"""`qkv plot FIGURE ...`: each figure's handler takes the parsed arguments and returns the files written."""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Callable

from qkv.cli.options import config_options, count
from qkv.errors import QkvError


def add_parsers(sub) -> None:
    plot = sub.add_parser("plot", help="figures: attention, pe, rope, loss, lr, gradnorm (PNG; HTML for attention)")
    figures = plot.add_subparsers(dest="figure", required=True, parser_class=type(plot))
    attention = figures.add_parser("attention", help="heat maps per layer and head for a text (and an HTML page)")
    attention.add_argument("run", help="run directory")
    attention.add_argument("--text", required=True, help="text to run through the model")
    attention.add_argument("--out", default="attention.png")
    attention.add_argument("--html", help="also write the interactive page here")
    pe = figures.add_parser("pe", help="sinusoidal positional encoding heat map and its frequencies")
    pe.add_argument("--d-model", type=count, default=128)
    pe.add_argument("--positions", type=count, default=100)
    pe.add_argument("--out", default="pe.png")
    rope = figures.add_parser("rope", help="RoPE rotation of q/k pairs and the relative score pattern")
    rope.add_argument("--head-dim", type=count, default=16)
    rope.add_argument("--positions", type=count, default=32)
    rope.add_argument("--out", default="rope.png")
    loss = figures.add_parser("loss", help="training and validation loss from metrics.csv")
    loss.add_argument("runs", nargs="+", help="run directories")
    loss.add_argument("--out", default="loss.png")
    lr = figures.add_parser("lr", help="the learning-rate schedules over a config's steps")
    config_options(lr, "shakespeare")
    lr.add_argument("--schedule", action="append", help="only these schedules (repeatable; default all)")
    lr.add_argument("--steps", type=count, help="steps to draw (default train.max_steps)")
    lr.add_argument("--out", default="lr.png")
    grad = figures.add_parser("gradnorm", help="gradient norm per layer at init, Pre-LN vs Post-LN")
    grad.add_argument("--layers", type=count, default=12)
    grad.add_argument("--out", default="gradnorm.png")


def cmd_plot(args) -> int:
    for path in FIGURES[args.figure](args):
        print(path)
    return 0


def token_strings(tokenizer, ids: list[int]) -> list[str]:
    """Each id decoded on its own (a byte-level piece may be part of a character: U+FFFD then)."""
    return [tokenizer.decode([i]) for i in ids]


def attention(args) -> list[Path]:
    """Heat maps per layer and head for `--text` through a run's model (a recording kernel, no flags)."""
    import torch

    from qkv.analysis import attention_html, plots
    from qkv.analysis.record import attention_maps
    from qkv.formats import load

    run = load(args.run)
    if not args.text:
        raise QkvError("--text must not be empty")
    ids = [run.tokenizer.start_id] + run.tokenizer.encode(args.text)  # streams start with <|endoftext|> (or <bos>)
    limit = run.config.model.max_seq_len
    if len(ids) > limit:
        raise QkvError(f"--text is {len(ids)} tokens with the start token; the model reads at most {limit}")
    ids_t = torch.tensor([ids])
    # an encoder-decoder reads the text as source and target: encoder, decoder and cross-attention maps
    maps = attention_maps(run.model, ids_t, ids_t if run.config.model.arch == "encoder-decoder" else None)
    names, arrays = list(maps), [m.numpy() for m in maps.values()]
    tokens = token_strings(run.tokenizer, ids)
    written = [plots.attention_grid(arrays, tokens, Path(args.out), names)]
    if args.html:
        written.append(attention_html.write(arrays, tokens, names, Path(args.html),
                                            title=f"attention of {Path(args.run).name}"))
    return written


def pe(args) -> list[Path]:
    from qkv.analysis import plots

    return [plots.sinusoidal_pe(Path(args.out), d_model=args.d_model, positions=args.positions)]


def rope(args) -> list[Path]:
    from qkv.analysis import plots

    return [plots.rope_rotation(Path(args.out), head_dim=args.head_dim, positions=args.positions)]


def loss(args) -> list[Path]:
    from qkv.analysis import plots

    return [plots.loss_curves([Path(r) for r in args.runs], Path(args.out))]


def lr(args) -> list[Path]:
    from qkv.analysis import plots
    from qkv.analysis.calc import resolve
    from qkv.schedules import SCHEDULES

    cfg = resolve(args.preset, args.config, args.set)
    train = cfg.train
    if args.steps:
        train = dataclasses.replace(train, max_steps=args.steps)
    for name in args.schedule or []:
        SCHEDULES.get(name)  # unknown names fail with the choices
    return [plots.lr_schedules(train, cfg.model.d_model, Path(args.out), args.schedule)]


def gradnorm(args) -> list[Path]:
    """Pre-LN vs Post-LN per-layer gradient norms at init (the setting of claim 31)."""
    import numpy as np

    from qkv.analysis import plots
    from qkv.analysis.record import layer_grad_norms
    from qkv.config import ModelConfig

    norms = {}
    for placement in ("pre", "post"):
        cfg = ModelConfig(vocab_size=128, d_model=32, n_heads=4, n_layers=args.layers, d_ff=128, max_seq_len=64,
                          norm_placement=placement, init="xavier", positional="sinusoidal")
        norms[f"{placement}-LN"] = list(np.mean([layer_grad_norms(cfg, seed=s, batch=4, seq=16) for s in range(3)],
                                                axis=0))
    return [plots.grad_norms(norms, Path(args.out))]


FIGURES: dict[str, Callable[..., list[Path]]] = {"attention": attention, "pe": pe, "rope": rope, "loss": loss,
                                                 "lr": lr, "gradnorm": gradnorm}

COMMANDS = {"plot": cmd_plot}
