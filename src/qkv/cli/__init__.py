"""The `qkv` command: one module per command group, each with its commands' options beside their handlers
(`add_parsers(sub)` and `COMMANDS`); this module assembles the parser and holds the error boundary.

Exit codes: 0 done; 2 bad input or usage (one line `qkv: error: ...` on stderr); 1 a bug; 130 interrupted.
A handler imports what its command runs when it runs (start-up time: `qkv --help` loads no model code).
"""
from __future__ import annotations

import os
import sys
import warnings

from qkv.cli import analysis, chat, convert, evaluate, generate, plot, probe, serve, train
from qkv.cli.options import Parser, main_rank
from qkv.errors import QkvError

GROUPS = (train, generate, chat, evaluate, serve, convert, analysis, probe, plot)  # the order of `qkv --help`
COMMANDS = {name: handler for group in GROUPS for name, handler in group.COMMANDS.items()}


def parser() -> Parser:
    root = Parser(prog="qkv", description="A complete Transformer system built straight from the math.")
    sub = root.add_subparsers(dest="command", required=True, parser_class=Parser)
    for group in GROUPS:
        group.add_parsers(sub)
    return root


def run() -> None:
    """The `qkv` program (its console script and `python -m qkv`): main(), then exit with its code."""
    import threading

    code = main()
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 or any(
            thread.name == "qkv-compile" and thread.is_alive() for thread in threading.enumerate()):
        # One rank of a torchrun launch whose run is complete (its process group already destroyed): leave
        # without the interpreter's teardown, where gloo's background threads can still abort the process
        # ("terminate called without an active exception") after a successful run. And a decoding step still
        # compiling in the background (qkv.generate.background.Background): the teardown would wait for the
        # compiler's workers to finish (45 s after a 20-token SmolLM2 generate, 2026-12-07).
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


def main(argv: list[str] | None = None) -> int:
    warnings.showwarning = show_warning
    try:
        args = parser().parse_args(argv)
        code = COMMANDS[args.command](args) or 0
        try:
            sys.stdout.flush()  # a full disk fails here, inside the error boundary
        except BrokenPipeError:
            raise
        except OSError as exc:
            quiet_stdout()
            return fail(f"cannot write the output: {exc.strerror or exc}")
        return code
    except QkvError as exc:
        return fail(str(exc))
    except KeyboardInterrupt:
        print("qkv: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader went away (`| head`): stop quietly
        quiet_stdout()
        return 0
    except OSError as exc:  # no space, read-only, permission, a missing file: the file and the reason
        where = f"{exc.filename}: " if exc.filename else ""
        return fail(f"{where}{exc.strerror or exc}")
    except RecursionError:
        return fail("input nested too deeply (a JSON file or value hundreds of levels deep)")
    except (UnicodeError, OverflowError) as exc:
        return fail(f"{type(exc).__name__.replace('Error', '').lower()} error: {exc}")


def show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    """A warning as one line `qkv: warning: ...` (not Python's file:line and source format)."""
    if main_rank():
        print(f"qkv: warning: {message}", file=sys.stderr)


def fail(message: str) -> int:
    """One line `qkv: error: ...`, exit code 2. Under torchrun every rank that fails says so, the others with
    their rank (`qkv: error: rank 1: ...`): the first rank to exit makes torchrun stop the rest, so a line left
    to rank 0 alone could be lost, and an error of one rank only would never be told."""
    rank = "" if main_rank() else f"rank {os.environ.get('RANK')}: "
    print(f"qkv: error: {rank}{message}", file=sys.stderr)
    return 2


def quiet_stdout() -> None:
    """Point stdout at /dev/null, so that the interpreter's last flush does not fail on the closed pipe."""
    try:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    except (OSError, ValueError):
        pass
