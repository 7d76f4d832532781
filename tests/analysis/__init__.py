"""Helpers for the analysis tests: the analysis sub-commands run in-process through qkv.cli (the same
`qkv: error:` line and exit 2 for bad input)."""
from __future__ import annotations

import contextlib
import io


def run_cli(*argv) -> tuple[int, str, str]:
    from qkv import cli

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = cli.main([str(a) for a in argv])
    return rc, out.getvalue(), err.getvalue()
