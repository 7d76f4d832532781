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
A choice's events and the API's logprobs / usage shapes: qkv.serve.choices; starting it: qkv.serve.server.
"""
from __future__ import annotations

import asyncio
import base64
import json
import secrets
import time
from dataclasses import dataclass
from importlib import resources

import torch
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from qkv.data.tokenizer import Tokenizer
from qkv.formats.base import Run
from qkv.formats.chat import ChatTemplate
from qkv.models.build import architecture_of
from qkv.models.heads import POOLINGS
from qkv.serve import api
from qkv.serve.api import ApiError, Completion
from qkv.serve.choices import (ChoiceEvents, chat_logprobs, collect, completion_logprobs,
                               echo_entries, failed, usage)
from qkv.serve.engine import Busy, Engine, Job

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
        return architecture_of(self.run.model).embeds


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


def start_jobs(served: Served, request: Completion) -> tuple[asyncio.Queue, list[Job], list[ChoiceEvents]]:
    """One Job per prompt x n, submitted together; 429 when the engine cannot queue them."""
    loop, queue = asyncio.get_running_loop(), asyncio.Queue()
    jobs, choices = [], []
    seq2seq = served.limits.seq2seq
    for p, prompt in enumerate(request.prompts):
        for j in range(request.n):
            index = p * request.n + j
            events = ChoiceEvents(index, served.tokenizer, request.stop, queue, loop, request.logprobs is not None,
                                  served.run.stop_ids)
            sampling = request.sampling
            seed = None if sampling.seed is None else sampling.seed + j
            jobs.append(Job(prompt=list(prompt), max_new=request.max_tokens, processors=sampling.processors,
                            params=sampling.params, seed=seed, stop_tokens=served.run.stop_ids,
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


# ------------------------------------------------------------------------------------------- endpoints


def make_app(served: Served) -> Starlette:
    page = resources.files("qkv.serve").joinpath("page.html").read_text(encoding="utf-8")

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
        start = () if served.limits.seq2seq else (served.tokenizer.start_id,)
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
        return JSONResponse({**head, "choices": out, "usage": usage(req, [r.count for r in results])})

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
                yield f"data: {json.dumps({**head, 'choices': [], 'usage': usage(req, counts)})}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            for job in jobs:
                job.cancel()

    async def embeddings(request: Request) -> Response:
        raw = await read_body(request, served)
        width = served.run.config.model.d_model if served.encoder else None
        req = api.read_embedding(raw, served.name, served.tokenizer, served.limits, width)
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
