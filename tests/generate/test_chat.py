"""qkv.generate.chat: a conversation's replies equal generation on the whole rendered conversation from an
empty cache (greedy), while each turn feeds only the tokens the cache does not hold yet."""
import torch

import qkv
from qkv.formats.chat import template_for
from qkv.generate import generate
from qkv.generate.chat import ChatSession, common_prefix
from tests.formats.gguf import write_llama


def test_turns_reuse_the_cache_and_reply_as_a_fresh_generation(tmp_path):
    run = qkv.load(write_llama(tmp_path / "m.gguf", seed=4))
    template = template_for(run.chat, run.tokenizer)
    session = ChatSession(run, template, system="Be brief.", strategy="greedy", max_new_tokens=6)
    fed = []
    forward = run.model.forward

    def counting(ids, *args, **kwargs):
        fed.append(ids.shape[1])
        return forward(ids, *args, **kwargs)

    run.model.forward = counting
    for turn in ("to be or not", "the question"):
        prompt, _ = template(session.messages + [{"role": "user", "content": turn}])
        fed.clear()
        reply = session.say(turn)
        session_fed = list(fed)
        expected = generate(run.model, torch.tensor([prompt]), max_new_tokens=6, strategy="greedy",
                            stop_tokens=run.stop_ids)[0, len(prompt):].tolist()
        expected = [t for t in expected if t not in run.stop_ids]
        assert reply == run.tokenizer.decode(expected)
        if turn == "the question":  # the first turn's tokens were in the cache: only the rest was fed
            assert session_fed[0] < len(prompt) and session_fed[1:] == [1] * len(session_fed[1:])
    session.reset()
    assert session.messages == [{"role": "system", "content": "Be brief."}] and session.cached == []


def test_common_prefix():
    assert common_prefix([1, 2, 3], [1, 2, 4, 5]) == 2 and common_prefix([], [1]) == 0
    assert common_prefix([1, 2], [1, 2]) == 2
