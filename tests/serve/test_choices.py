"""The shapes of a choice's parts (qkv.serve.choices), validated by the `openai` library's own response types
(the oracle for what its clients parse): the completions and chat logprobs objects and usage; alternatives
that decode alike keep the likeliest; echo's first prompt token and offsets."""
from openai.types import CompletionUsage
from openai.types.chat.chat_completion import ChoiceLogprobs
from openai.types.completion_choice import Logprobs

from qkv.serve.choices import chat_logprobs, completion_logprobs, echo_entries, first_of_each, usage


def entry(token_id, text, logprob, offset, top=()):
    return {"id": token_id, "token": text, "logprob": logprob, "bytes": list(text.encode()), "offset": offset,
            "top": [(i, t, lp, list(t.encode())) for i, t, lp in top]}


ENTRIES = [entry(5, "Lear", -0.5, 0, [(5, "Lear", -0.5), (9, "King", -1.5)]),
           entry(7, " is", -0.25, 4, [(7, " is", -0.25), (8, " was", -2.0)])]


def test_completion_logprobs_parse_as_openais():
    obj = completion_logprobs(ENTRIES, offset=10)
    parsed = Logprobs.model_validate(obj)
    assert parsed.tokens == ["Lear", " is"] and parsed.token_logprobs == [-0.5, -0.25]
    assert parsed.text_offset == [10, 14]  # offsets into the whole text (echo's prompt before it)
    assert parsed.top_logprobs == [{"Lear": -0.5, "King": -1.5}, {" is": -0.25, " was": -2.0}]


def test_chat_logprobs_parse_as_openais():
    parsed = ChoiceLogprobs.model_validate(chat_logprobs(ENTRIES))
    first = parsed.content[0]
    assert (first.token, first.logprob, first.bytes) == ("Lear", -0.5, list(b"Lear"))
    assert [(t.token, t.logprob) for t in first.top_logprobs] == [("Lear", -0.5), ("King", -1.5)]
    assert parsed.refusal is None


def test_alternatives_that_decode_alike_keep_the_likeliest():
    top = [(200, "\ufffd", -1.0, [0xe2]), (201, "\ufffd", -3.0, [0xe3]), (5, "a", -2.0, [97])]
    assert first_of_each(top) == {"\ufffd": -1.0, "a": -2.0}


class Request:
    prompts, n = ((0, 5, 6), (0, 7)), 2


def test_usage_counts_the_prompt_once_per_choice():
    counts = usage(Request(), [3, 4, 1, 2])
    parsed = CompletionUsage.model_validate(counts)
    assert (parsed.prompt_tokens, parsed.completion_tokens, parsed.total_tokens) == (10, 10, 20)


class Chars:
    eos_id = 0
    token_bytes = {i: bytes([i]) for i in range(256)}

    def decode(self, ids):
        return "".join(chr(i) for i in ids)


def test_echo_keeps_the_start_token_out_and_gives_a_first_token_no_logprob():
    prompt = [entry(66, "B", -1.0, 0)]
    assert echo_entries(prompt, (0, 66), Chars()) == prompt  # qkv's start token is not part of the text
    echoed = echo_entries(prompt, (65, 66), Chars())  # an id prompt: its first token has nothing before it
    assert echoed[0]["token"] == "A" and echoed[0]["logprob"] is None and echoed[0]["top"] == []
    assert echoed[1]["offset"] == 1  # after "A"
