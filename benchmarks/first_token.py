"""Time to first token of `qkv chat` as a user starts it (no flags), and when the compiled step takes over.

    python benchmarks/first_token.py MODEL.gguf [--quant int4] [--starts 2]

Each start is a new process: `qkv chat MODEL --strategy greedy` with the given precision, asked one message,
then another every few seconds until it says the compiled step (compiled in the background: qkv.generate.
background.Background) took over. The first start uses an empty inductor cache (a first start on a machine), the
later ones the cache it left. Printed per start: seconds from the process's start to the first byte of the
first reply, the background compile's seconds as the step reports them, and the reply speed before and after
(tokens of 32-token greedy replies per second, stdout bytes timed as they stream)."""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import threading
import time

MESSAGES = ("Tell me about the sea.", "What is a cat?", "Name three colours.", "Why is the sky blue?")


def one_start(model: str, precision: list[str], cache: str, timeout: float = 900) -> dict:
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache)
    env.pop("QKV_COMPILE", None)
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "qkv", "chat", model, "--strategy", "greedy",
                             "--max-new-tokens", "32", *precision], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, bufsize=0)
    errors: list[str] = []
    threading.Thread(target=lambda: errors.extend(line.decode() for line in proc.stderr), daemon=True).start()
    result, replies, turn = {}, [], 0
    while time.perf_counter() - start < timeout:
        sent = time.perf_counter()
        proc.stdin.write((MESSAGES[turn % len(MESSAGES)] + "\n").encode())
        proc.stdin.flush()
        first, data = None, b""
        while not data.endswith(b"\n"):
            byte = proc.stdout.read(1)
            if not byte:
                raise SystemExit(f"qkv chat ended: {''.join(errors)}")
            first = first or time.perf_counter()
            data += byte
        if turn == 0:
            result["first_token_s"] = first - start
        took_over = any("takes over" in line for line in errors)
        replies.append((took_over, time.perf_counter() - first))
        if took_over:
            seconds = next(re.search(r"in (\d+) s", line) for line in errors if "takes over" in line)
            result["compiled_in_background_s"] = int(seconds.group(1))
            break
        turn += 1
        time.sleep(max(0.0, 5.0 - (time.perf_counter() - sent)))  # (a user typing the next message)
    proc.stdin.close()
    proc.wait(60)
    eager = [s for over, s in replies if not over]
    result["reply_s_eager"] = round(min(eager), 2) if eager else None
    result["reply_s_compiled"] = round(replies[-1][1], 2) if replies[-1][0] else None
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("--quant", help="none, int8 or int4; without it a GGUF file's blocks as shipped")
    parser.add_argument("--dtype", default="fp32")
    parser.add_argument("--starts", type=int, default=2)
    args = parser.parse_args()
    precision = (["--quant", args.quant] if args.quant else []) + ["--dtype", args.dtype]
    with tempfile.TemporaryDirectory() as cache:
        for start in range(args.starts):
            print(f"start {start + 1} ({'empty cache' if start == 0 else 'cache of start 1'}):",
                  one_start(args.model, precision, cache), flush=True)


if __name__ == "__main__":
    main()
