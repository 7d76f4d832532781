"""`qkv serve` under load: aggregate tokens/s and time to first token with 1, 4 and 16 concurrent clients.

    python benchmarks/serve.py [RUN] [--clients 1 4 16] [--requests 32] [--max-tokens 64] [--threads 2]
        [--dtype fp32|bf16] [--quant none|int8|int4] [--max-batch 16] [--server-threads N] [--compile] [--no-peer]
        [--llama-server BIN --llama-gguf FILE] [--repeats 1]

RUN is a qkv run or a Hugging Face dir (default: the shakespeare preset's model with random weights, written
to a temporary dir). Each setting starts `qkv serve RUN` in its own process, on a free port, and has every
client send streaming greedy completions (different prompts, `max_tokens` new tokens each, no stop string:
a request ends early only at the end-of-text token) one after the other until `--requests` are done in all. Reported: aggregate
new tokens/s over the wall time, the median time to first token (request sent -> first text chunk), the
ratio to the one-client figure, and the requests that failed (no usage chunk; their tokens not counted). The peer in the same run is the same server without batching
(`--max-batch 1`: requests decoded one at a time, in arrival order), at the same client counts.

`--llama-server BIN --llama-gguf FILE` adds llama.cpp's own HTTP server (`llama-server`, built from llama.cpp's
source; a benchmark peer, never a dependency) serving FILE (the GGUF file at the precision compared: the Q4_1
file itself, or one `qkv convert --to-gguf` writes) with `--max-batch` parallel slots, the same threads and the
same clients, requests and completions endpoint. Every server is started first and the client counts then
alternate between them (`--repeats R`: R rounds, medians reported), so a slow moment of a shared machine falls
on all of them.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

PROMPTS = ["To be, or not to be", "Now is the winter of our discontent", "O Romeo, Romeo", "Friends, Romans",
           "All the world's a stage", "If music be the food of love", "Once more unto the breach", "What light"]


def default_run(path: Path) -> Path:
    import torch
    from safetensors.torch import save_file

    import qkv
    from qkv import files, presets
    from qkv.data.tokenizer import Tokenizer

    cfg = presets.get("shakespeare")
    torch.manual_seed(0)
    text = "\n".join(PROMPTS) * 50
    tokenizer = Tokenizer.train([text], 300)
    model_cfg = qkv.ModelConfig(**{**cfg.model.__dict__, "vocab_size": tokenizer.vocab_size})
    path.mkdir(parents=True, exist_ok=True)
    type(cfg)(model=model_cfg).save(path / "config.json")
    tokenizer.save(path / "tokenizer.json")
    save_file(files.model_tensors(qkv.build_model(model_cfg)), str(path / files.MODEL_FILE))
    return path


def start(run: Path, max_batch: int, threads: int, extra: list[str] = ()) -> tuple[subprocess.Popen, str]:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "qkv", "serve", str(run), "--port", "0", "--max-batch",
                             str(max_batch), "--name", "bench", *extra], env=env, stderr=subprocess.PIPE, text=True)
    line = proc.stderr.readline()
    while line.startswith("qkv:") and " on http" not in line:  # what it runs at, before the address
        line = proc.stderr.readline()
    if " on http" not in line:
        proc.kill()
        raise SystemExit(f"the server did not start: {line}")
    return proc, line.split(" on ")[1].split()[0]


def start_llama(binary: str, gguf: str, slots: int, threads: int, max_tokens: int) -> tuple[subprocess.Popen, str]:
    """llama.cpp's server on a free port: `slots` parallel sequences (its continuous batching), a context of 256
    tokens each, `threads` for decode and prefill; its log discarded. Ready when /health answers 200."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    context = slots * max(256, 2 * max_tokens)
    proc = subprocess.Popen([binary, "-m", gguf, "--host", "127.0.0.1", "--port", str(port), "-np", str(slots),
                             "-c", str(context), "-t", str(threads), "-tb", str(threads), "--no-webui"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"llama-server exited with {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise SystemExit("llama-server did not become ready in 300 s")


def load(url: str, clients: int, requests: int, max_tokens: int) -> dict:
    queue = list(range(requests))
    lock = threading.Lock()
    first, tokens, failed = [], [0], [0]

    def client():
        # a connection per request (llama-server may close a kept-alive one between requests): the same for all
        with httpx.Client(timeout=600, headers={"Connection": "close"}) as http:
            while True:
                with lock:
                    if not queue:
                        return
                    i = queue.pop()
                body = {"model": "bench", "prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": max_tokens,
                        "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
                sent, seen, done = time.perf_counter(), False, False
                try:
                    with http.stream("POST", url + "/v1/completions", json=body) as response:
                        for line in response.iter_lines():
                            if not line.startswith("data: ") or line == "data: [DONE]":
                                continue
                            chunk = json.loads(line[6:])
                            if not seen and chunk["choices"]:
                                first.append(time.perf_counter() - sent)
                                seen = True
                            if chunk.get("usage"):
                                done = True
                                with lock:
                                    tokens[0] += chunk["usage"]["completion_tokens"]
                except httpx.HTTPError:
                    pass
                if not done:  # counted and reported: its tokens are not
                    with lock:
                        failed[0] += 1

    start_time = time.perf_counter()
    workers = [threading.Thread(target=client) for _ in range(clients)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    seconds = time.perf_counter() - start_time
    return {"tokens_per_s": tokens[0] / seconds, "ttft_s": statistics.median(first), "tokens": tokens[0],
            "seconds": seconds, "failed": failed[0]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("run", nargs="?")
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json")
    parser.add_argument("--dtype", default="fp32", help="the server's --dtype")
    parser.add_argument("--quant", default="none", help="the server's --quant")
    parser.add_argument("--max-batch", type=int, default=16, help="the batching server's --max-batch")
    parser.add_argument("--no-peer", action="store_true", help="skip the unbatched server")
    parser.add_argument("--server-threads", type=int, help="the server's --threads (default: its own choice)")
    parser.add_argument("--compile", action="store_true", help="the server's --compile (its step compiled before it listens; "
                        "without: --no-compile)")
    parser.add_argument("--llama-server", help="llama.cpp's llama-server binary: a peer in the same run")
    parser.add_argument("--llama-gguf", help="the GGUF file llama-server serves (its precision)")
    parser.add_argument("--repeats", type=int, default=1, help="rounds over the client counts (medians)")
    args = parser.parse_args()
    if bool(args.llama_server) != bool(args.llama_gguf):
        parser.error("--llama-server and --llama-gguf go together")
    if args.llama_server and not (os.access(args.llama_server, os.X_OK) and Path(args.llama_gguf).is_file()):
        parser.error(f"no executable {args.llama_server} or no file {args.llama_gguf}")
    run = Path(args.run) if args.run else default_run(Path(tempfile.mkdtemp()) / "shakespeare-random")
    extra = ["--dtype", args.dtype, "--quant", args.quant]
    extra += ["--threads", str(args.server_threads)] if args.server_threads else []
    extra += ["--compile"] if args.compile else ["--no-compile"]  # (not the default's step switched in mid-run)
    servers = {}  # label -> (process, url), all started before any is measured
    try:
        servers["qkv serve (continuous batching)"] = start(run, args.max_batch, args.threads, extra)
        if not args.no_peer:
            servers["no batching (--max-batch 1)"] = start(run, 1, args.threads, extra)
        if args.llama_server:
            servers[f"llama-server (-np {args.max_batch})"] = start_llama(
                args.llama_server, args.llama_gguf, args.max_batch, args.threads, args.max_tokens)
        for _, url in servers.values():
            load(url, 1, 2, 8)  # warm-up
        measured: dict[tuple[str, int], list[dict]] = {}
        for _ in range(args.repeats):
            for clients in args.clients:
                for label, (_, url) in servers.items():
                    result = load(url, clients, max(args.requests, clients), args.max_tokens)
                    measured.setdefault((label, clients), []).append(result)
                    print(f"{label}, {clients} clients: {result['tokens_per_s']:.0f} tokens/s", file=sys.stderr)
    finally:
        for proc, _ in servers.values():
            proc.terminate()
        for proc, _ in servers.values():
            proc.wait(60)
    rows = []
    for label in servers:
        for clients in args.clients:
            results = measured[label, clients]
            rows.append({"server": label, "clients": clients, "rounds": len(results),
                         **{key: statistics.median(r[key] for r in results) for key in results[0]}})
    print(f"{'server':<34} {'clients':>7} {'tokens/s':>9} {'x 1 client':>10} {'TTFT median':>12} {'failed':>6}")
    for row in rows:
        one = next(r for r in rows if r["server"] == row["server"] and r["clients"] == args.clients[0])
        print(f"{row['server']:<34} {row['clients']:>7} {row['tokens_per_s']:>9.0f} "
              f"{row['tokens_per_s'] / one['tokens_per_s']:>10.2f} {row['ttft_s'] * 1000:>9.0f} ms "
              f"{row['failed']:>6.0f}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
