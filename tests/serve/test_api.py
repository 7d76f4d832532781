"""The OpenAI request fields, read without a server (qkv.serve.api): a well-formed completion request becomes
the description the engine runs (prompts as ids after the start token, defaults as OpenAI's), and each kind
of bad field is one ApiError with OpenAI's status, param and code (tests/serve/test_server.py sends the same
through the real `openai` client)."""
import pytest

from qkv.serve.api import MAX_N, ApiError, Limits, read_completion, read_embedding, read_messages

LIMITS = Limits(context=32, vocab=300, max_tokens=20, seq2seq=False)
START = (0,)


class Chars:
    """A stand-in tokenizer: one id per character (ord + 1, so 0 is free for the start token)."""

    def encode(self, text: str) -> list[int]:
        return [ord(c) + 1 for c in text]

    def decode(self, ids) -> str:
        return "".join(chr(i - 1) for i in ids)


def completion(**fields):
    return read_completion({"model": "m", **fields}, "m", Chars(), LIMITS, START)


def test_a_completion_request_with_openais_defaults():
    c = completion(prompt="ab")
    assert c.prompts == ((0, 98, 99),) and c.texts == ("ab",)  # the start token, then the text
    assert (c.max_tokens, c.n, c.stop, c.stream, c.logprobs, c.echo) == (16, 1, (), False, None, False)
    ids = completion(prompt=[[5, 6], [7]], max_tokens=3, n=2, stop="\n", temperature=0)
    assert ids.prompts == ((5, 6), (7,)) and ids.texts == ("\x04\x05", "\x06")  # ids used as given
    assert (ids.max_tokens, ids.n, ids.stop) == (3, 2, ("\n",)) and ids.sampling.processors is None  # greedy


@pytest.mark.parametrize("fields,status,param,code", [
    ({"prompt": "a", "colour": 1}, 400, "colour", "unknown_parameter"),
    ({"prompt": "a", "model": "other"}, 404, "model", "model_not_found"),
    ({"prompt": "a", "model": 3}, 400, "model", "missing_required_parameter"),
    ({}, 400, "prompt", "missing_required_parameter"),
    ({"prompt": "a", "n": MAX_N + 1}, 400, "n", "invalid_value"),
    ({"prompt": "a", "n": 1.5}, 400, "n", "invalid_type"),
    ({"prompt": "a", "temperature": True}, 400, "temperature", "invalid_type"),
    ({"prompt": "a", "top_p": 0}, 400, "top_p", "invalid_value"),
    ({"prompt": "a", "max_tokens": 21}, 400, "max_tokens", "invalid_value"),  # over --max-tokens
    ({"prompt": "a" * 31, "max_tokens": 5}, 400, "max_tokens", "context_length_exceeded"),
    ({"prompt": "a" * 40}, 400, "prompt", "context_length_exceeded"),
    ({"prompt": [[300]]}, 400, "prompt", "invalid_value"),  # outside the vocabulary
    ({"prompt": [[]]}, 400, "prompt", "invalid_type"),
    ({"prompt": "a", "max_tokens": 0}, 400, "max_tokens", "invalid_value"),
    ({"prompt": "a", "stop": 5}, 400, "stop", "invalid_type"),
    ({"prompt": "a", "stream_options": {"include_usage": True}}, 400, "stream_options", "invalid_value"),
    ({"prompt": "a", "best_of": 3}, 400, "best_of", "unsupported_parameter"),
    ({"prompt": "a", "suffix": "z"}, 400, "suffix", "unsupported_parameter"),
    ({"prompt": "a", "logprobs": 21}, 400, "logprobs", "invalid_value"),
])
def test_each_bad_field_is_one_api_error(fields, status, param, code):
    with pytest.raises(ApiError) as caught:
        completion(**fields)
    error = caught.value
    assert (error.status, error.param, error.code) == (status, param, code)
    body = error.body()["error"]
    assert body["message"] and body["type"] == "invalid_request_error" and body["param"] == param


def test_a_body_that_is_not_an_object_is_invalid_json():
    with pytest.raises(ApiError) as caught:
        read_completion(["prompt"], "m", Chars(), LIMITS, START)
    assert (caught.value.status, caught.value.code) == (400, "invalid_json")


def test_messages_and_embeddings_are_checked_too():
    assert read_messages([{"role": "user", "content": "hi"}]) == [{"role": "user", "content": "hi"}]
    for bad, param in (([], "messages"), ([{"role": "king", "content": "x"}], "messages[0]"),
                       ([{"role": "user", "content": 3}], "messages[0].content")):
        with pytest.raises(ApiError) as caught:
            read_messages(bad)
        assert caught.value.param == param
    with pytest.raises(ApiError) as caught:
        read_embedding({"model": "m", "input": "x"}, "m", Chars(), LIMITS, None)  # no encoder served
    assert caught.value.param == "model"
