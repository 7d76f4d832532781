"""Helpers for the Hugging Face interop tests: random-initialised transformers models from tiny configs
(never a download), saved with save_pretrained, and a CLI entry point with `convert` wired in."""
from __future__ import annotations

import contextlib
import io
from pathlib import Path

import torch

import qkv.cli
from qkv import hf_commands as commands

V = 100  # vocabulary of the random models


def save_hf(model, path: Path) -> Path:
    model.eval().save_pretrained(path)
    return path


def right_padded(batch: int, length: int, lengths: list[int], low: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    """Random ids (B, T) and a mask with row b's first lengths[b] tokens real (right padding)."""
    ids = torch.randint(low, V, (batch, length))
    mask = (torch.arange(length)[None, :] < torch.tensor(lengths)[:, None]).long()
    return ids, mask


def max_diff(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor | None = None) -> float:
    """Max |a - b| over the real (unpadded) positions."""
    if mask is not None:
        a, b = a[mask.bool()], b[mask.bool()]
    return float((a - b).abs().max())


def cli(*argv: str) -> tuple[int, str, str]:
    """qkv.cli.main with `convert` wired in as the lead wires it (the parser and the command table)."""
    build = qkv.cli.parser

    def parser():
        root = build()
        sub = next(a for a in root._actions if getattr(a, "choices", None) and "train" in a.choices)
        if "convert" not in sub.choices:
            commands.add_parsers(sub)
        return root

    out, err = io.StringIO(), io.StringIO()
    saved_parser, saved_commands = qkv.cli.parser, dict(qkv.cli.COMMANDS)
    qkv.cli.parser = parser
    qkv.cli.COMMANDS.setdefault("convert", commands.cmd_convert)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = qkv.cli.main(list(argv))
    finally:
        qkv.cli.parser = saved_parser
        qkv.cli.COMMANDS.clear()
        qkv.cli.COMMANDS.update(saved_commands)
    return code, out.getvalue(), err.getvalue()
