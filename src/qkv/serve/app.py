"""The HTTP side of `qkv serve`: a Starlette app on uvicorn, speaking the OpenAI API (docs/serve.md).

    GET  /                      the playground page (one self-contained file, qkv/serve/page.html)
    GET  /health                {"status": "ok", "running": n, "waiting": m}
    GET  /v1/models             the one served model
    POST /v1/completions        prompt(s) -> choices; stream: server-sent events ending with `data: [DONE]`
    POST /v1/chat/completions   messages -> the model's chat template -> choices (delta chunks when streaming)
    POST /v1/embeddings         an encoder run's pooled hidden states

Every request becomes one engine Job per choice (qkv.serve.engine); the Job's callbacks run on the engine's
thread and hand their events to the request's asyncio queue. A client that goes away (a closed stream, or a
non-streaming request whose connection drops) cancels its jobs: their rows leave the batch before the next
step. Errors are OpenAI's body {"error": {...}} with 400 (a bad field), 401 (no or a wrong API key), 404 (an
unknown model or path), 405, 413 (a body over MAX_BODY), 429 (the queue is full) and 500 (a bug, the
request alone fails).
"""
from __future__ import annotations

import asyncio
import base64
import json
import secrets
import time
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import torch
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from qkv.data.tokenizer import StreamDecoder, Tokenizer
from qkv.errors import QkvError
from qkv.generate.text import TextStream
from qkv.models.encoder_decoder import EncoderDecoder
from qkv.models.heads import POOLINGS, EncoderClassifier, EncoderMLM
from qkv.run import Run
from qkv.serve import api
from qkv.serve.api import ApiError, Completion
from qkv.serve.chat import ChatTemplate, template_for
from qkv.serve.engine import THREADS, Busy, Choice, Engine, Job

MAX_BODY = 4 * 2 ** 20  # bytes of one request body


@dataclass
class Served:
    run: Run
    name: str
    engine: Engine
    template: ChatTemplate
    limits: api.Limits
    api_key: str | None
    created: int

    @property
    def tokenizer(self) -> Tokenizer:
        return self.run.tokenizer

    @property
    def encoder(self) -> bool:
        return isinstance(self.run.model, (EncoderMLM, EncoderClassifier))


def error(exc: ApiError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status)


async def read_body(request: Request, served: Served):
    """The request's JSON object, after the API key and the size are checked."""
    check_key(request, served)
    declared = request.headers.get("content-length")
    if declared is not None and (not declared.isdigit() or int(declared) > MAX_BODY):
        raise ApiError(413, f"the request body is over {MAX_BODY} bytes", None, "request_too_large")
    data = bytearray()
    try:
        async for chunk in request.stream():
            data += chunk
            if len(data) > MAX_BODY:
                raise ApiError(413, f"the request body is over {MAX_BODY} bytes", None, "request_too_large")
    except ClientDisconnect:
        raise ApiError(400, "the client closed the connection before sending the body") from None
    try:
        return json.loads(data)
    except (ValueError, RecursionError) as exc:
        raise ApiError(400, f"the request body is not valid JSON: {exc}", None, "invalid_json") from None


def check_key(request: Request, served: Served) -> None:
    if served.api_key is None:
        return
    given = request.headers.get("authorization", "")
    scheme, _, key = given.partition(" ")
    if scheme.lower() != "bearer" or not secrets.compare_digest(key.strip().encode(), served.api_key.encode()):
        raise ApiError(401, "invalid or missing API key: send the header `Authorization: Bearer KEY`", None,
                       "invalid_api_key")


# ------------------------------------------------------------------------------------- choices as events


class ChoiceEvents:
    """One choice's text and logprobs, built on the engine's thread, sent to the request's queue as events:
    ("prompt", [token entries]), ("token", text piece, token entry | None), ("done", text piece, reason, error)."""

    def __init__(self, index: int, tokenizer: Tokenizer, stop: tuple[str, ...], queue: asyncio.Queue,
                 loop: asyncio.AbstractEventLoop, want_logprobs: bool):
        self.index, self.tokenizer, self.queue, self.loop = index, tokenizer, queue, loop
        self.text = TextStream(tokenizer, stop, Pieces())
        self.want_logprobs = want_logprobs
        self.offset = 0  # characters of the continuation before the next token (text_offset)
        self.tokens = 0

    def send(self, *event) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, (self.index, *event))

    def entry(self, choice: Choice, offset: int) -> dict:
        return {"id": choice.token, "token": self.tokenizer.decode([choice.token]), "logprob": choice.logprob,
                "top": [(i, self.tokenizer.decode([i]), lp) for i, lp in choice.top], "offset": offset}

    def on_prompt(self, choices: list[Choice]) -> None:
        decoder, offset, entries = StreamDecoder(self.tokenizer), 0, []
        for choice in choices:
            entries.append(self.entry(choice, offset))
            offset += len(decoder.push(choice.token))
        self.send("prompt", entries)

    def on_token(self, choice: Choice) -> bool:
        self.tokens += 1
        before = len(self.text.text)
        stop = self.text.push(choice.token)
        self.text.write()
        entry = self.entry(choice, self.offset) if self.want_logprobs else None
        self.offset += len(self.text.text) - before
        self.send("token", self.text.stream.take(), entry)
        return stop

    def on_done(self, reason: str, message: str | None) -> None:
        self.text.finish()
        self.send("done", self.text.stream.take(), reason, message)


class Pieces:
    """A TextStream's output: what was written since the last take()."""

    def __init__(self):
        self.parts: list[str] = []

    def write(self, text: str) -> None:
        self.parts.append(text)

    def flush(self) -> None:
        pass

    def take(self) -> str:
        text, self.parts = "".join(self.parts), []
        return text


def start_jobs(served: Served, request: Completion) -> tuple[asyncio.Queue, list[Job], list[ChoiceEvents]]:
    """One Job per prompt x n, submitted together; 429 when the engine cannot queue them."""
    loop, queue = asyncio.get_running_loop(), asyncio.Queue()
    jobs, choices = [], []
    seq2seq = served.limits.seq2seq
    for p, prompt in enumerate(request.prompts):
        for j in range(request.n):
            index = p * request.n + j
            events = ChoiceEvents(index, served.tokenizer, request.stop, queue, loop, request.logprobs is not None)
            sampling = request.sampling
            seed = None if sampling.seed is None else sampling.seed + j
            jobs.append(Job(prompt=list(prompt), max_new=request.max_tokens, processors=sampling.processors,
                            params=sampling.params, seed=seed, stop_tokens=(served.tokenizer.eos_id,),
                            top_logprobs=request.logprobs, echo=request.echo,
                            decoder_start=served.tokenizer.eos_id if seq2seq else None,
                            on_prompt=events.on_prompt, on_token=events.on_token, on_done=events.on_done))
            choices.append(events)
    try:
        served.engine.submit(*jobs)
    except Busy as exc:
        raise ApiError(429, f"the server is at capacity: {exc}; retry later", None, "rate_limit_exceeded",
                       kind="rate_limit_error") from None
    return queue, jobs, choices


class Collected:
    """A choice's whole result, for a non-streaming response."""

    def __init__(self):
        self.text, self.prompt, self.tokens, self.reason, self.error, self.count = "", [], [], None, None, 0


async def collect(request: Request, queue: asyncio.Queue, jobs: list[Job]) -> list[Collected]:
    results = [Collected() for _ in jobs]
    remaining = len(jobs)
    try:
        while remaining:
            try:
                index, kind, *rest = await asyncio.wait_for(queue.get(), timeout=0.5)
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    raise asyncio.CancelledError from None
                continue
            result = results[index]
            if kind == "prompt":
                result.prompt = rest[0]
            elif kind == "token":
                result.text += rest[0]
                result.count += 1
                if rest[1] is not None:
                    result.tokens.append(rest[1])
            else:
                result.text += rest[0]
                result.reason, result.error = rest[1], rest[2]
                remaining -= 1
    finally:
        for job in jobs:
            job.cancel()  # no-op for finished jobs; frees the rows of a client that left
    return results


def usage(request: Completion, results) -> dict:
    prompt = sum(len(p) for p in request.prompts) * request.n
    completion = sum(r.count for r in results)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def completion_logprobs(entries: list[dict], offset: int = 0) -> dict:
    """OpenAI's completions logprobs object from token entries."""
    return {"tokens": [e["token"] for e in entries], "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": [first_of_each(e["top"]) for e in entries],
            "text_offset": [offset + e["offset"] for e in entries]}


def first_of_each(top: list) -> dict:
    """{token text: logprob}, most likely first; tokens that decode alike (bytes of one character: U+FFFD)
    keep the likeliest one's logprob, as a dict can hold one."""
    out: dict = {}
    for _, token, logprob in top:
        out.setdefault(token, logprob)
    return out


def chat_logprobs(entries: list[dict]) -> dict:
    def item(token: str, token_id: int, logprob: float) -> dict:
        return {"token": token, "logprob": logprob, "bytes": list(token_bytes(token_id))}

    token_bytes = TOKEN_BYTES.get
    return {"content": [{**item(e["token"], e["id"], e["logprob"]),
                         "top_logprobs": [item(t, i, lp) for i, t, lp in e["top"]]} for e in entries],
            "refusal": None}


TOKEN_BYTES: dict = {}  # filled per server: id -> the bytes the token stands for


def failed(results) -> str | None:
    return next((r.error for r in results if r.error), None)


# ------------------------------------------------------------------------------------------- endpoints


def make_app(served: Served) -> Starlette:
    page = resources.files("qkv.serve").joinpath("page.html").read_text(encoding="utf-8")
    TOKEN_BYTES.update(enumerate(served.tokenizer.token_bytes))

    def model_card() -> dict:
        return {"id": served.name, "object": "model", "created": served.created, "owned_by": "qkv",
                "max_model_len": served.limits.context}

    async def index(request: Request) -> Response:
        return HTMLResponse(page)

    async def health(request: Request) -> Response:
        running, waiting = served.engine.load
        return JSONResponse({"status": "ok", "running": running, "waiting": waiting})

    async def models(request: Request) -> Response:
        check_key(request, served)
        return JSONResponse({"object": "list", "data": [model_card()]})

    async def one_model(request: Request) -> Response:
        check_key(request, served)
        if request.path_params["name"] != served.name:
            raise ApiError(404, f"the model {request.path_params['name']!r} does not exist", "model",
                           "model_not_found")
        return JSONResponse(model_card())

    def generator_only() -> None:
        if served.encoder:
            raise ApiError(400, f"{served.name} is an encoder: it answers /v1/embeddings, not completions",
                           "model", "unsupported_model")

    async def completions(request: Request) -> Response:
        raw = await read_body(request, served)
        generator_only()
        start = () if served.limits.seq2seq else (served.tokenizer.eos_id,)
        req = api.read_completion(raw, served.name, served.tokenizer, served.limits, start)
        return await respond(request, req, chat=False)

    async def chat(request: Request) -> Response:
        raw = await read_body(request, served)
        generator_only()
        try:
            req, _ = api.read_chat(raw, served.name, served.limits, served.template)
        except ValueError as exc:  # the template refused the messages
            raise ApiError(400, str(exc), "messages") from None
        return await respond(request, req, chat=True)

    async def respond(request: Request, req: Completion, chat: bool) -> Response:
        queue, jobs, choices = start_jobs(served, req)
        ident = ("chatcmpl-" if chat else "cmpl-") + secrets.token_hex(12)
        created = int(time.time())
        head = {"id": ident, "object": "chat.completion" if chat else "text_completion", "created": created,
                "model": served.name}
        if req.stream:
            return StreamingResponse(stream(request, req, queue, jobs, head, chat), media_type="text/event-stream",
                                     headers={"cache-control": "no-cache", "x-accel-buffering": "no"})
        results = await collect(request, queue, jobs)
        message = failed(results)
        if message:
            raise ApiError(500, message, None, "internal_error", kind="server_error")
        out = []
        for index, (result, events) in enumerate(zip(results, choices)):
            prompt_text = req.texts[index // req.n] if req.echo else ""
            reason = result.reason
            if chat:
                out.append({"index": index, "message": {"role": "assistant", "content": result.text, "refusal": None},
                            "logprobs": chat_logprobs(result.tokens) if req.logprobs is not None else None,
                            "finish_reason": reason})
            else:
                logprobs = None
                if req.logprobs is not None:
                    entries = result.tokens
                    if req.echo:  # the prompt's tokens, then the new ones (their offsets after the prompt's text)
                        entries = echo_entries(result.prompt, req.prompts[index // req.n], served.tokenizer) + \
                            [{**e, "offset": e["offset"] + len(prompt_text)} for e in result.tokens]
                    logprobs = completion_logprobs(entries)
                out.append({"text": prompt_text + result.text, "index": index, "logprobs": logprobs,
                            "finish_reason": reason})
        return JSONResponse({**head, "choices": out, "usage": usage(req, results)})

    async def stream(request: Request, req: Completion, queue: asyncio.Queue, jobs: list[Job], head: dict,
                     chat: bool):
        head = {**head, "object": "chat.completion.chunk" if chat else "text_completion"}
        remaining, counts = len(jobs), [0] * len(jobs)

        def chunk(choice: dict) -> str:
            return f"data: {json.dumps({**head, 'choices': [choice]})}\n\n"

        try:
            if chat:
                for index in range(len(jobs)):
                    yield chunk({"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                 "finish_reason": None})
            while remaining:
                index, kind, *rest = await queue.get()
                if kind == "prompt":  # echo: the prompt's text and logprobs come first
                    text = req.texts[index // req.n]
                    entries = echo_entries(rest[0], req.prompts[index // req.n], served.tokenizer)
                    logprobs = completion_logprobs(entries) if req.logprobs is not None else None
                    yield chunk({"text": text, "index": index, "logprobs": logprobs, "finish_reason": None})
                    continue
                if kind == "token":
                    counts[index] += 1
                    piece, entry = rest
                    reason = None
                else:
                    piece, entry, reason = rest[0], None, rest[1]
                    if rest[2]:
                        yield f"data: {json.dumps(ApiError(500, rest[2], None, 'internal_error', 'server_error').body())}\n\n"
                        return
                    remaining -= 1
                if not piece and entry is None and reason is None:
                    continue
                if chat:
                    delta = {"content": piece} if piece or entry is not None else {}
                    logprobs = chat_logprobs([entry]) if entry is not None else None
                    yield chunk({"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": reason})
                else:
                    offset = len(req.texts[index // req.n]) if req.echo else 0
                    logprobs = completion_logprobs([entry], offset) if entry is not None else None
                    yield chunk({"text": piece, "index": index, "logprobs": logprobs, "finish_reason": reason})
            if req.include_usage:
                results = [type("R", (), {"count": c}) for c in counts]
                yield f"data: {json.dumps({**head, 'choices': [], 'usage': usage(req, results)})}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            for job in jobs:
                job.cancel()

    async def embeddings(request: Request) -> Response:
        raw = await read_body(request, served)
        req = api.read_embedding(raw, served.name, served.tokenizer, served.limits, served.encoder)
        api.dimensions_check(raw, served.run.config.model.d_model)
        loop, done = asyncio.get_running_loop(), asyncio.Event()
        box: dict = {}

        def work():  # on the engine's thread, between two decoding steps
            try:
                box["vectors"] = pooled(served.run, req.inputs)
            except Exception as exc:  # a bug: this request fails
                box["error"] = f"{type(exc).__name__}: {exc}"
            loop.call_soon_threadsafe(done.set)

        served.engine.call(work)
        await done.wait()
        if "error" in box:
            raise ApiError(500, box["error"], None, "internal_error", kind="server_error")
        data = []
        for index, vector in enumerate(box["vectors"]):
            value = base64.b64encode(vector.astype("<f4").tobytes()).decode() if req.base64 else vector.tolist()
            data.append({"object": "embedding", "index": index, "embedding": value})
        tokens = sum(len(ids) for ids in req.inputs)
        return JSONResponse({"object": "list", "data": data, "model": served.name,
                             "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})

    async def on_error(request: Request, exc: Exception) -> Response:
        if isinstance(exc, ApiError):
            return error(exc)
        if isinstance(exc, HTTPException):
            kind = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
            return error(ApiError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}", None, kind))
        return error(ApiError(500, f"internal error: {type(exc).__name__}", None, "internal_error", "server_error"))

    routes = [Route("/", index), Route("/health", health), Route("/v1/models", models),
              Route("/v1/models/{name:path}", one_model), Route("/v1/completions", completions, methods=["POST"]),
              Route("/v1/chat/completions", chat, methods=["POST"]),
              Route("/v1/embeddings", embeddings, methods=["POST"])]
    return Starlette(routes=routes, exception_handlers={ApiError: on_error, HTTPException: on_error,
                                                         Exception: on_error})


def echo_entries(prompt: list[dict], ids: tuple[int, ...], tokenizer: Tokenizer) -> list[dict]:
    """The prompt's token entries for echo: its first token has no logprob (nothing before it), unless it is
    qkv's start token, which is not part of the text and is left out."""
    if ids and ids[0] == tokenizer.eos_id:
        return prompt
    first = {"id": ids[0], "token": tokenizer.decode([ids[0]]), "logprob": None, "top": [], "offset": 0}
    shift = len(first["token"])
    return [first] + [{**e, "offset": e["offset"] + shift} for e in prompt]


def pooled(run: Run, inputs) -> list:
    """Each input's pooled final hidden states (the run's model.pooling: first token or mean), float32."""
    model = run.model
    pool = POOLINGS.get(run.config.model.pooling)
    device = next(model.parameters()).device
    out = []
    for ids in inputs:
        hidden = model.encoder(torch.tensor([ids], device=device))  # (1, T, D)
        out.append(pool(hidden, None)[0].float().cpu().numpy())
    return out


def served_model(run: Run, name: str | None, *, max_batch: int, max_queue: int, max_tokens: int | None,
                 api_key: str | None, threads: int | None = None) -> Served:
    model = run.model
    context = model.max_seq_len if not isinstance(model, (EncoderMLM, EncoderClassifier)) else \
        run.config.model.max_seq_len
    seq2seq = isinstance(model, EncoderDecoder)
    limit = context - 1  # a decoder needs a prompt token; an encoder-decoder's decoder its start token
    limits = api.Limits(context=context, vocab=run.tokenizer.vocab_size,
                        max_tokens=min(limit, max_tokens or limit), seq2seq=seq2seq)
    on_cpu = next(model.parameters()).device.type == "cpu"
    engine = Engine(model, max_batch=max_batch, max_queue=max_queue, threads=threads or (THREADS if on_cpu else None))
    return Served(run=run, name=name or Path(run.path).name, engine=engine,
                  template=template_for(run.path, run.tokenizer), limits=limits, api_key=api_key,
                  created=int(time.time()))


def prepare(path: str, *, max_batch: int = 16, max_queue: int = 64, max_tokens: int | None = None,
            api_key: str | None = None, name: str | None = None, device: str = "cpu", threads: int | None = None,
            log=print) -> Served:
    """Load RUN (a qkv run or a Hugging Face dir) and make its engine (not started yet)."""
    from qkv.run import load

    run = load(path, device)
    if run.tokenizer is None:
        raise QkvError(f"{path}: has no tokenizer.json; the server reads and writes text")
    for module in run.model.modules():  # capacity drops would make a row's output depend on the others
        if getattr(module, "capacity_factor", 0):
            log(f"qkv: serving with MoE capacity off (model.moe_capacity_factor={module.capacity_factor} "
                "drops tokens by batch; a request's output must not depend on the others)")
            module.capacity_factor = 0.0
    return served_model(run, name, max_batch=max_batch, max_queue=max_queue, max_tokens=max_tokens,
                        api_key=api_key, threads=threads)


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
    finish (up to GRACE seconds; the rest are cancelled) and return."""
    served = prepare(path, log=log, **options)
    sock = listen(host, port)
    server = server_for(served)
    served.engine.start()
    shown = f"[{host}]" if ":" in host else host
    log(f"qkv: serving {served.name} ({sum(p.numel() for p in served.run.model.parameters()):,} parameters, "
        f"context {served.limits.context}) on http://{shown}:{sock.getsockname()[1]} (max batch "
        f"{served.engine.max_batch}{', API key required' if served.api_key else ''})")
    # uvicorn stops gracefully on SIGINT / SIGTERM, then raises the signal again for the handler it found:
    # a stop asked for is the normal end of a server (exit 0), so that handler does nothing
    import signal

    previous = {sig: signal.signal(sig, lambda *_: None) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        server.run(sockets=[sock])
    finally:
        served.engine.stop()
        sock.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    log("qkv: server stopped")


GRACE = 30  # seconds the requests in flight get to finish after SIGTERM
