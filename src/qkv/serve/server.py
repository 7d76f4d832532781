"""Starting `qkv serve`: load the run, make its engine, bind the socket, run uvicorn until a signal."""
from __future__ import annotations

import threading
import time
from pathlib import Path

from qkv.errors import QkvError
from qkv.formats import merge_adapter
from qkv.formats.base import Run
from qkv.formats.chat import template_for
from qkv.generate import background, compiled, weights
from qkv.models.build import architecture_of
from qkv.serve import api
from qkv.serve.app import Served, make_app
from qkv.serve.engine import THREADS, Engine


def served_model(run: Run, name: str | None, *, max_batch: int, max_queue: int, max_tokens: int | None,
                 api_key: str | None, threads: int | None = None, main_thread: bool = False) -> Served:
    """`main_thread`: the engine will run on the main thread (Engine.run), with torch's own threads by default;
    else on a thread of its own (Engine.start), with THREADS on CPU."""
    model = run.model
    architecture = architecture_of(model)
    context = run.config.model.max_seq_len if architecture.embeds else model.max_seq_len
    seq2seq = architecture.prompt == "source"
    limit = context - 1  # a decoder needs a prompt token; an encoder-decoder's decoder its start token
    limits = api.Limits(context=context, vocab=run.tokenizer.vocab_size,
                        max_tokens=min(limit, max_tokens or limit), seq2seq=seq2seq)
    on_cpu = next(model.parameters()).device.type == "cpu"
    default = THREADS if on_cpu and not main_thread else None
    engine = Engine(model, max_batch=max_batch, max_queue=max_queue, threads=threads or default)
    return Served(run=run, name=name or Path(run.path).name, engine=engine,
                  template=template_for(run.chat, run.tokenizer), limits=limits, api_key=api_key,
                  created=int(time.time()))


def prepare(path: str, *, max_batch: int = 16, max_queue: int = 64, max_tokens: int | None = None,
            api_key: str | None = None, name: str | None = None, device: str = "cpu", threads: int | None = None,
            dtype: str = "fp32", quant: str | None = None, compile: str = "off", main_thread: bool = False,
            kv_dtype: str | None = None, adapter: str | None = None, log=print) -> Served:
    """Load RUN (a qkv run or a Hugging Face dir) and make its engine (not started yet), at `dtype` / `quant`
    (qkv.generate.weights), its KV caches in `kv_dtype` (default the model's); `adapter`: a LoRA adapter (PEFT
    dir or GGUF file) merged into the fp32 weights first; `compile`: its decoding step compiled
    (qkv.generate.compiled) before it serves ("now"), while it serves ("background": it takes over when ready,
    where it applies on the CPU) or not ("off")."""
    run = weights.load(path, dtype=dtype, quant=quant, device=device, stream=not adapter)  # GGUF: block by block
    if adapter:
        log(merge_adapter(run, adapter))
    for warning in weights.check(dtype, quant, next(run.model.parameters()).device):
        log(warning)
    if dtype == "bf16":
        log("qkv: warning: with --dtype bf16 a request's greedy tokens may differ with the batch it shares (bf16 "
            "rounds the padded batch's attention differently from a lone request's); --dtype fp32 keeps them "
            "independent, also with --quant int8 / int4")
    description = weights.prepare(run.model, dtype=dtype, quant=quant)  # fuses Q/K/V and gate/up too
    if description != "fp32 weights":
        log(f"qkv: serving at {description}")
    kv = weights.set_kv_dtype(run.model, kv_dtype)
    if kv:
        log(kv)
    if run.tokenizer is None:
        raise QkvError(f"{path}: has no tokenizer.json; the server reads and writes text")
    for module in run.model.modules():  # capacity drops would make a row's output depend on the others
        if getattr(module, "capacity_factor", 0):
            log(f"qkv: serving with MoE capacity off (model.moe_capacity_factor={module.capacity_factor} "
                "drops tokens by batch; a request's output must not depend on the others)")
            module.capacity_factor = 0.0
    served = served_model(run, name, max_batch=max_batch, max_queue=max_queue, max_tokens=max_tokens,
                          api_key=api_key, threads=threads, main_thread=main_thread)
    if compile == "now":
        compile_step(served, log)
    elif compile == "background" and next(run.model.parameters()).device.type == "cpu":
        try:
            background.enable_in_background(run.model, served.engine.threads, rows=(1, 2), prompt=False,
                                          announce=log)
        except ValueError:
            pass  # (the general step: not every model has a compiled one)
    elif compile not in ("off", "background"):
        raise ValueError(f"compile={compile!r}: 'now', 'background' or 'off'")
    return served


def compile_step(served: Served, log) -> None:
    """--compile: the engine's decoding step compiled before the server listens, so no request waits for it."""
    try:
        compiled.enable(served.run.model)
    except ValueError as exc:
        raise QkvError(f"--compile: {exc}") from None
    log("qkv: --compile: compiling the decoding step for one row and for batches (a few minutes on 2 cores the "
        "first time; later starts read inductor's cache)")
    seconds = background.warm_up(served.run.model, served.engine.threads)
    step = compiled.compiled_step(served.run.model)
    if step.failed is None:
        log(f"qkv: --compile: compiled in {seconds:.0f} s")


def listen(host: str, port: int):
    import socket

    try:
        sock = socket.create_server((host, port), family=socket.AF_INET6 if ":" in host else socket.AF_INET)
    except OSError as exc:
        raise QkvError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    # accepted connections inherit it: uvicorn writes a response's head and body apart, and with Nagle's
    # algorithm the body of every reply on a kept-alive connection waited ~40 ms for the client's delayed ACK
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def server_for(served: Served):
    import uvicorn

    config = uvicorn.Config(make_app(served), log_level="warning", timeout_graceful_shutdown=GRACE, lifespan="off")
    return uvicorn.Server(config)


def serve(path: str, *, host: str, port: int, log=print, **options) -> None:
    """Serve RUN on host:port until SIGINT / SIGTERM: then stop accepting, let the requests in flight
    finish (up to GRACE seconds; the rest are cancelled) and return. The engine decodes on this (the main)
    thread and the HTTP side runs on another: torch's OpenMP threads run at full speed only from the main
    thread (qkv.serve.engine.THREADS)."""
    served = prepare(path, log=log, main_thread=True, **options)
    sock = listen(host, port)
    server = server_for(served)
    shown = f"[{host}]" if ":" in host else host
    log(f"qkv: serving {served.name} ({sum(p.numel() for p in served.run.model.parameters()):,} parameters, "
        f"context {served.limits.context}) on http://{shown}:{sock.getsockname()[1]} (max batch "
        f"{served.engine.max_batch}{', API key required' if served.api_key else ''})")

    def http() -> None:
        try:
            server.run(sockets=[sock])  # (off the main thread uvicorn leaves the signals to us)
        finally:
            served.engine.stop()  # the requests in flight have finished or been cancelled: the loop ends

    def on_signal(*_) -> None:  # uvicorn's own rule: the first signal stops gracefully, a second at once
        if server.should_exit:
            server.force_exit = True
        server.should_exit = True

    import signal

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    thread = threading.Thread(target=http, name="qkv-http", daemon=True)
    thread.start()
    try:
        served.engine.run()
    finally:
        server.should_exit = True
        thread.join(GRACE + 10)
        sock.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    log("qkv: server stopped")


GRACE = 30  # seconds the requests in flight get to finish after SIGTERM
