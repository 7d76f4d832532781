"""Helpers for the analysis tests: the analysis sub-commands run in-process, through qkv.cli when it wires
them and through a parser built by qkv.analysis.commands.add_parsers otherwise (same handlers, same
`qkv: error:` line and exit 2 for bad input)."""
from __future__ import annotations

import contextlib
import io


def run_cli(*argv) -> tuple[int, str, str]:
    from qkv import cli
    from qkv.analysis import commands
    from qkv.errors import QkvError

    argv = [str(a) for a in argv]
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        if argv[0] in cli.COMMANDS:
            rc = cli.main(argv)
        else:
            root = cli.Parser(prog="qkv")
            commands.add_parsers(root.add_subparsers(dest="command", required=True, parser_class=cli.Parser))
            try:
                args = root.parse_args(argv)
                rc = commands.COMMANDS[args.command](args) or 0
            except QkvError as exc:
                print(f"qkv: error: {exc}", file=err)
                rc = 2
    return rc, out.getvalue(), err.getvalue()
