"""One choice of a request as it is made, and the shapes OpenAI gives its parts.

`ChoiceEvents` holds one choice's text (qkv.generate.text.TextStream: stop strings cut it, and streaming
never passes one) and turns the engine's callbacks, which run on the engine's thread, into events on the
request's asyncio queue:

    ("prompt", [token entries])                     echo: the prompt's tokens with their logprobs
    ("token", settled text, token entry | None)     each new token (its entry when logprobs are asked)
    ("done", the rest of the text, reason, error)   once: "stop", "length" or "cancelled"

`collect` gathers them for a non-streaming reply; `completion_logprobs` and `chat_logprobs` are the two
logprobs objects of the API, `usage` its token counts.
"""
from __future__ import annotations

import asyncio

from starlette.requests import Request

from qkv.data.tokenizer import StreamDecoder, Tokenizer
from qkv.generate.text import TextStream
from qkv.serve.api import Completion
from qkv.serve.engine import Job
from qkv.serve.logprobs import Choice


class ChoiceEvents:
    """One choice's text and logprobs, built on the engine's thread, sent to the request's queue as events:
    ("prompt", [token entries]), ("token", text piece, token entry | None), ("done", text piece, reason, error)."""

    def __init__(self, index: int, tokenizer: Tokenizer, stop: tuple[str, ...], queue: asyncio.Queue,
                 loop: asyncio.AbstractEventLoop, want_logprobs: bool, stop_ids: tuple[int, ...] = ()):
        self.index, self.tokenizer, self.queue, self.loop = index, tokenizer, queue, loop
        self.text = TextStream(tokenizer, stop, Pieces(), stop_ids)
        self.want_logprobs = want_logprobs
        self.offset = 0  # characters of the continuation before the next token (text_offset)
        self.tokens = 0

    def send(self, *event) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, (self.index, *event))

    def entry(self, choice: Choice, offset: int) -> dict:
        """A token for the logprobs objects: its id, text, logprob, bytes, the top alternatives as
        (id, text, logprob, bytes), and its offset in the text."""
        text, table = self.tokenizer.decode, self.tokenizer.token_bytes
        return {"id": choice.token, "token": text([choice.token]), "logprob": choice.logprob,
                "bytes": list(table[choice.token]), "offset": offset,
                "top": [(i, text([i]), lp, list(table[i])) for i, lp in choice.top]}

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


def usage(request: Completion, counts: list[int]) -> dict:
    """OpenAI's usage: the prompt's tokens once per choice, and every new token."""
    prompt = sum(len(p) for p in request.prompts) * request.n
    completion = sum(counts)
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
    for _, token, logprob, _ in top:
        out.setdefault(token, logprob)
    return out


def chat_logprobs(entries: list[dict]) -> dict:
    """OpenAI's chat logprobs object from token entries."""
    return {"content": [{"token": e["token"], "logprob": e["logprob"], "bytes": e["bytes"],
                         "top_logprobs": [{"token": t, "logprob": lp, "bytes": b} for _, t, lp, b in e["top"]]}
                        for e in entries], "refusal": None}


def failed(results) -> str | None:
    return next((r.error for r in results if r.error), None)


def echo_entries(prompt: list[dict], ids: tuple[int, ...], tokenizer: Tokenizer) -> list[dict]:
    """The prompt's token entries for echo: its first token has no logprob (nothing before it), unless it is
    qkv's start token, which is not part of the text and is left out."""
    if ids and ids[0] == tokenizer.eos_id:
        return prompt
    first = {"id": ids[0], "token": tokenizer.decode([ids[0]]), "logprob": None, "top": [], "offset": 0,
             "bytes": list(tokenizer.token_bytes[ids[0]])}
    shift = len(first["token"])
    return [first] + [{**e, "offset": e["offset"] + shift} for e in prompt]
