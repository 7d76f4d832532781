"""The OpenAI API's request fields, checked, and its response shapes (docs/serve.md lists every field).

Each request body is read into a frozen description (`Completion`, `Embedding`) by `read_completion`,
`read_chat` and `read_embedding`, which raise `ApiError` (status, message, param, code) for anything the
server would otherwise have to guess about: a field of the wrong type or out of range, an unknown field, a
prompt that does not fit the context, an option this model cannot honour. The app turns an ApiError into
OpenAI's error body, {"error": {"message", "type", "param", "code"}}.

Sampling, as OpenAI defines it: temperature 0 is greedy (argmax); otherwise the chain is temperature, top-k
(an extension, as vLLM's), top-p, then one draw from the request's own torch.Generator seeded with `seed`
(choice j of n: seed + j). Logprobs are the model's own distribution, log softmax of the logits at
temperature 1, whatever the sampling settings (as vLLM's default): the numbers `qkv eval` scores with.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from qkv.data.tokenizer import Tokenizer
from qkv.generate.sampling import SamplingParams

MAX_LOGPROBS = 20  # top alternatives per token
MAX_STOPS = 16
MAX_N = 16

# fields a client may send that change nothing in qkv's output: accepted, never acted on
METADATA = {"user", "metadata", "store", "service_tier"}


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


def invalid(param: str, message: str, code: str = "invalid_value") -> ApiError:
    return ApiError(400, message, param, code)


@dataclass(frozen=True)
class Sampling:
    processors: tuple[str, ...] | None  # None: greedy
    params: SamplingParams
    seed: int | None


@dataclass(frozen=True)
class Completion:
    """A completions or chat request, read and checked: one prompt (ids) per entry of `prompts`."""

    prompts: tuple[tuple[int, ...], ...]
    max_tokens: int
    n: int
    sampling: Sampling
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    logprobs: int | None  # None: none; k: the chosen token's and the top k alternatives
    echo: bool
    texts: tuple[str, ...]  # each prompt as text (echo returns it)


@dataclass(frozen=True)
class Embedding:
    inputs: tuple[tuple[int, ...], ...]
    base64: bool


@dataclass(frozen=True)
class Limits:
    """What the served model and the server's options allow."""

    context: int  # the model's max_seq_len
    vocab: int
    max_tokens: int  # --max-tokens: the most new tokens one request may ask for
    seq2seq: bool


class Body:
    """A JSON object's fields, each read with its type and range; a field not in `known` is refused at once."""

    def __init__(self, body, known: set[str]):
        if not isinstance(body, dict):
            raise ApiError(400, "the request body must be a JSON object", None, "invalid_json")
        unknown = sorted(set(body) - known - METADATA)
        if unknown:
            raise invalid(unknown[0], f"unrecognized request argument supplied: {unknown[0]} (docs/serve.md "
                                      "lists the supported fields)", "unknown_parameter")
        self.fields = body

    def get(self, name: str, default=None):
        value = self.fields.get(name)
        return default if value is None else value

    def number(self, name: str, default: float | None, low: float, high: float, *, integer: bool = False,
               low_open: bool = False):
        value = self.get(name, default)
        if value is None:
            return None
        kind = "an integer" if integer else "a number"
        if isinstance(value, bool) or not isinstance(value, (int, float)) or (integer and not isinstance(value, int)):
            raise invalid(name, f"{name} must be {kind}, got {type(value).__name__}", "invalid_type")
        if isinstance(value, float) and not math.isfinite(value):
            raise invalid(name, f"{name} must be finite, got {value}")
        if value < low or value > high or (low_open and value == low):
            left = "(" if low_open else "["
            raise invalid(name, f"{name}={value} is out of range: it must be in {left}{low}, {high}]")
        return value

    def flag(self, name: str, default: bool = False) -> bool:
        value = self.get(name, default)
        if not isinstance(value, bool):
            raise invalid(name, f"{name} must be true or false, got {type(value).__name__}", "invalid_type")
        return value

    def neutral(self, name: str, neutral, why: str) -> None:
        """A field qkv accepts only at its neutral value (an option it does not implement)."""
        value = self.get(name)
        if value is not None and value != neutral:
            raise invalid(name, f"{name}={value!r} is not supported: {why}", "unsupported_parameter")


def read_model(body: Body, served: str) -> None:
    model = body.get("model")
    if not isinstance(model, str):
        raise invalid("model", "you must provide a model parameter (a string; GET /v1/models lists it)",
                      "missing_required_parameter")
    if model != served:
        raise ApiError(404, f"the model {model!r} does not exist; this server serves {served!r}", "model",
                       "model_not_found")


def read_sampling(body: Body) -> Sampling:
    temperature = body.number("temperature", 1.0, 0.0, 2.0)
    top_p = body.number("top_p", 1.0, 0.0, 1.0, low_open=True)
    top_k = body.number("top_k", -1, -1, 2 ** 31, integer=True)
    if top_k == 0:
        raise invalid("top_k", "top_k must be >= 1, or -1 for no limit")
    seed = body.number("seed", None, -2 ** 63, 2 ** 63 - 1, integer=True)
    body.neutral("presence_penalty", 0, "qkv has no presence penalty")
    body.neutral("frequency_penalty", 0, "qkv has no frequency penalty")
    body.neutral("logit_bias", {}, "qkv has no logit bias")
    if temperature == 0:
        for name, value, neutral in (("top_p", top_p, 1.0), ("top_k", top_k, -1)):
            if value != neutral:
                raise invalid(name, f"{name}={value} has no effect with temperature=0 (greedy decoding)",
                              "unsupported_parameter")
        return Sampling(None, SamplingParams(), None)
    params = SamplingParams(temperature=float(temperature), top_p=float(top_p),
                            top_k=2 ** 31 if top_k == -1 else top_k)
    return Sampling(("temperature", "top_k", "top_p"), params, seed)


def read_stop(body: Body) -> tuple[str, ...]:
    stop = body.get("stop", [])
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise invalid("stop", "stop must be a string or a list of strings", "invalid_type")
    if len(stops) > MAX_STOPS:
        raise invalid("stop", f"stop has {len(stops)} strings; at most {MAX_STOPS}")
    return tuple(s for s in stops if s)


def read_stream(body: Body) -> tuple[bool, bool]:
    stream = body.flag("stream")
    options = body.get("stream_options")
    if options is None:
        return stream, False
    if not stream:
        raise invalid("stream_options", "stream_options is only allowed with stream=true")
    if not isinstance(options, dict) or set(options) - {"include_usage"} or \
            not isinstance(options.get("include_usage", False), bool):
        raise invalid("stream_options", 'stream_options must be {"include_usage": true|false}')
    return stream, options.get("include_usage", False)


def read_prompts(value, tokenizer: Tokenizer, vocab: int, param: str, prefix: tuple[int, ...]):
    """A string, a list of strings, a list of ids or a list of id lists -> ((ids, text) ...).

    A text is encoded after `prefix` (qkv's start-of-text token for a language model); ids are used as given."""
    def ids_of(item, where: str) -> tuple[tuple[int, ...], str]:
        if isinstance(item, str):
            return prefix + tuple(tokenizer.encode(item)), item
        if isinstance(item, list) and item and all(isinstance(i, int) and not isinstance(i, bool) for i in item):
            bad = [i for i in item if not 0 <= i < vocab]
            if bad:
                raise invalid(param, f"{where} has token id {bad[0]} outside the vocabulary [0, {vocab})")
            return tuple(item), tokenizer.decode(item)
        raise invalid(param, f"{where} must be a string or a non-empty list of token ids", "invalid_type")

    if isinstance(value, str) or (isinstance(value, list) and value and isinstance(value[0], int)):
        return [ids_of(value, param)]
    if not isinstance(value, list) or not value:
        raise invalid(param, f"{param} must be a string, a list of strings, or token ids", "invalid_type")
    return [ids_of(item, f"{param}[{i}]") for i, item in enumerate(value)]


def check_context(prompts, max_tokens: int, limits: Limits, param: str) -> None:
    """Each prompt and its max_tokens fit the context: prompt + new for a decoder; for an encoder-decoder the
    source alone, and the decoder's start token + new."""
    for ids in prompts:
        if not ids:
            raise invalid(param, "the prompt is empty")
        if len(ids) > limits.context:
            raise invalid(param, f"this model's maximum context length is {limits.context} tokens; the prompt "
                                 f"has {len(ids)}", "context_length_exceeded")
        needed = 1 + max_tokens if limits.seq2seq else len(ids) + max_tokens
        if needed > limits.context:
            asked = f"its start token + {max_tokens} new" if limits.seq2seq else f"{len(ids)} prompt + {max_tokens} new"
            raise invalid("max_tokens", f"this model's maximum context length is {limits.context} tokens; the "
                                        f"request needs {asked} tokens", "context_length_exceeded")


def read_max_tokens(body: Body, names: tuple[str, ...], default, limits: Limits) -> int:
    given = [name for name in names if body.get(name) is not None]
    if len(given) > 1:
        raise invalid(given[1], f"give one of {' or '.join(names)}, not both")
    name = given[0] if given else names[0]
    value = body.number(name, None, 0, 2 ** 31, integer=True)
    if value is None:
        return default
    if value > limits.max_tokens:
        raise invalid(name, f"{name}={value} exceeds this server's --max-tokens {limits.max_tokens}")
    return value


def read_common(body: Body):
    n = body.number("n", 1, 1, MAX_N, integer=True)
    stream, include_usage = read_stream(body)
    return n, read_sampling(body), read_stop(body), stream, include_usage


COMPLETION_FIELDS = {"model", "prompt", "max_tokens", "temperature", "top_p", "top_k", "n", "stream",
                     "stream_options", "logprobs", "echo", "stop", "seed", "presence_penalty", "frequency_penalty",
                     "logit_bias", "best_of", "suffix"}


def read_completion(raw, served: str, tokenizer: Tokenizer, limits: Limits, start: tuple[int, ...]) -> Completion:
    body = Body(raw, COMPLETION_FIELDS)
    read_model(body, served)
    n, sampling, stop, stream, include_usage = read_common(body)
    body.neutral("best_of", n, "best_of must equal n (qkv returns every choice it generates)")
    body.neutral("suffix", "", "qkv models do not fill in the middle")
    logprobs = body.number("logprobs", None, 0, MAX_LOGPROBS, integer=True)
    echo = body.flag("echo")
    if echo and limits.seq2seq:
        raise invalid("echo", "echo scores the prompt as text the model continues; an encoder-decoder reads it "
                              "as its source", "unsupported_parameter")
    if "prompt" not in raw:
        raise invalid("prompt", "you must provide a prompt", "missing_required_parameter")
    items = read_prompts(raw["prompt"], tokenizer, limits.vocab, "prompt", () if limits.seq2seq else start)
    max_tokens = read_max_tokens(body, ("max_tokens",), min(16, limits.max_tokens), limits)
    if max_tokens == 0 and not echo:
        raise invalid("max_tokens", "max_tokens=0 generates nothing; it is only useful with echo=true")
    prompts = tuple(ids for ids, _ in items)
    check_context(prompts, max_tokens, limits, "prompt")
    if echo and any(len(ids) < 2 for ids in prompts) and logprobs is not None and not start:
        raise invalid("prompt", "echo with logprobs needs at least two prompt tokens")
    return Completion(prompts, max_tokens, n, sampling, stop, stream, include_usage, logprobs, echo,
                      tuple(text for _, text in items))


CHAT_FIELDS = {"model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "n",
               "stream", "stream_options", "logprobs", "top_logprobs", "stop", "seed", "presence_penalty",
               "frequency_penalty", "logit_bias"}
ROLES = ("system", "developer", "user", "assistant")


def read_messages(value) -> list[dict]:
    if not isinstance(value, list) or not value:
        raise invalid("messages", "messages must be a non-empty list of {role, content} objects", "invalid_type")
    messages = []
    for i, message in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(message, dict) or message.get("role") not in ROLES:
            raise invalid(where, f"{where} must be an object with role one of {', '.join(ROLES)}")
        content = message.get("content")
        if isinstance(content, list):  # content parts: text only
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise invalid(f"{where}.content", "only text content parts are supported", "unsupported_parameter")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise invalid(f"{where}.content", f"{where}.content must be a string", "invalid_type")
        extra = sorted(set(message) - {"role", "content", "name"})
        if extra:
            raise invalid(f"{where}.{extra[0]}", f"{where}.{extra[0]} is not supported (no tools in qkv)",
                          "unsupported_parameter")
        messages.append({"role": message["role"], "content": content})
    return messages


def read_chat(raw, served: str, limits: Limits, render) -> tuple[Completion, list[dict]]:
    """`render(messages) -> (ids, default stop strings)` is the model's chat template (qkv.formats.chat)."""
    body = Body(raw, CHAT_FIELDS)
    read_model(body, served)
    if limits.seq2seq:
        raise invalid("model", "chat completions need a language model; this encoder-decoder answers "
                               "/v1/completions (the prompt is its source)", "unsupported_model")
    n, sampling, stop, stream, include_usage = read_common(body)
    messages = read_messages(raw.get("messages"))
    ids, template_stop = render(messages)
    want_logprobs = body.flag("logprobs")
    top = body.number("top_logprobs", None, 0, MAX_LOGPROBS, integer=True)
    if top is not None and not want_logprobs:
        raise invalid("top_logprobs", "top_logprobs needs logprobs=true")
    room = max(0, limits.context - len(ids))
    max_tokens = read_max_tokens(body, ("max_completion_tokens", "max_tokens"), min(room, limits.max_tokens), limits)
    if max_tokens == 0:
        raise invalid("max_tokens", "the reply has no room: max_tokens is 0 or the messages fill the context")
    check_context([ids], max_tokens, limits, "messages")
    completion = Completion((tuple(ids),), max_tokens, n, sampling, stop or template_stop, stream, include_usage,
                            (top or 0) if want_logprobs else None, False, ("",))
    return completion, messages


EMBEDDING_FIELDS = {"model", "input", "encoding_format", "dimensions"}


def read_embedding(raw, served: str, tokenizer: Tokenizer, limits: Limits, width: int | None) -> Embedding:
    """`width`: the encoder's hidden size (None: the served model is not an encoder)."""
    body = Body(raw, EMBEDDING_FIELDS)
    read_model(body, served)
    if width is None:
        raise invalid("model", "embeddings come from an encoder run (model.arch=encoder); this model is a "
                               "generator", "unsupported_model")
    dims = body.get("dimensions")
    if dims is not None and dims != width:
        raise invalid("dimensions", f"dimensions={dims!r}: this model's embeddings have {width} (qkv does not "
                                    "truncate them)", "unsupported_parameter")
    fmt = body.get("encoding_format", "float")
    if fmt not in ("float", "base64"):
        raise invalid("encoding_format", f"encoding_format must be float or base64, got {fmt!r}")
    if "input" not in raw:
        raise invalid("input", "you must provide an input", "missing_required_parameter")
    items = read_prompts(raw["input"], tokenizer, limits.vocab, "input", ())
    for i, (ids, _) in enumerate(items):
        if not ids:
            raise invalid("input", f"input[{i}] is empty")
        if len(ids) > limits.context:
            raise invalid("input", f"input[{i}] has {len(ids)} tokens; this model reads at most {limits.context}",
                          "context_length_exceeded")
    return Embedding(tuple(ids for ids, _ in items), fmt == "base64")
