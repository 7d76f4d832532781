"""A conversation with a model (`qkv chat`): the model's chat template renders the whole conversation at
every turn, and the tokens whose keys and values the KV cache already holds are not fed again.

    session = ChatSession(run, template, system="Be brief.", strategy="top-p", settings=...)
    reply = session.say("What is the capital of France?", on_text=print)   # streams, returns the reply
    session.reset()                                                          # a new conversation

Each turn: prompt = template(messages); the cache keeps the longest common prefix of what it holds and the
new prompt (usually everything but the new user turn: a reply re-encodes to the tokens that were sampled
unless the template rewrites it) and is fed the rest; the reply is decoded until one of the run's stop ids
(its end-of-turn tokens) or a stop string of the template.
"""
from __future__ import annotations

from typing import Callable

import torch

from qkv.errors import QkvError
from qkv.formats.base import Run
from qkv.generate.compiled import next_logits, prompt_logits
from qkv.generate.decode import eval_mode
from qkv.generate.sampling import STRATEGIES, SamplingParams, SamplingState, make_generator, process
from qkv.generate.text import TextStream
from qkv.nn.decoding_linear import decoding_linears


class Pieces:
    """A TextStream's sink: hands each settled piece to a callback."""

    def __init__(self, on_text: Callable[[str], None] | None):
        self.on_text = on_text

    def write(self, text: str) -> None:
        if self.on_text is not None and text:
            self.on_text(text)

    def flush(self) -> None:
        pass


class ChatSession:
    def __init__(self, run: Run, template, *, system: str | None = None, strategy: str = "top-p",
                 params: SamplingParams = SamplingParams(temperature=0.7), seed: int | None = None,
                 max_new_tokens: int = 512):
        if getattr(run.model, "new_cache", None) is None:
            raise QkvError("qkv chat needs a decoder-only language model")
        if STRATEGIES.get(strategy).choose is None:
            raise QkvError("qkv chat streams its reply token by token; beam search cannot (choose greedy or sampling)")
        self.run, self.template, self.system = run, template, system
        self.strategy, self.params, self.max_new = STRATEGIES.get(strategy), params.validate(), max_new_tokens
        device = next(run.model.parameters()).device
        self.generator = make_generator(seed, device) if self.strategy.samples else None
        self.device = device
        self.reset()

    def reset(self) -> None:
        self.messages = [{"role": "system", "content": self.system}] if self.system else []
        self.cache, self.cached = None, []  # the KV cache and the ids whose keys and values it holds

    def say(self, text: str, on_text: Callable[[str], None] | None = None) -> str:
        """One user turn: the streamed reply (also kept in the conversation)."""
        self.messages.append({"role": "user", "content": text})
        try:
            reply = self.reply(on_text)
        except BaseException:
            self.messages.pop()
            self.cache, self.cached = None, []
            raise
        self.messages.append({"role": "assistant", "content": reply})
        return reply

    def reply(self, on_text) -> str:
        model, context = self.run.model, self.run.model.max_seq_len
        prompt, stop_strings = self.template(self.messages)
        if len(prompt) + 1 > context:
            raise QkvError(f"the conversation is {len(prompt)} tokens, the model reads {context}: /reset to start again")
        max_new = min(self.max_new, context - len(prompt))
        text = TextStream(self.run.tokenizer, stop_strings, Pieces(on_text), self.run.stop_ids)
        stops = set(self.run.stop_ids)
        with torch.inference_mode(), eval_mode(model), decoding_linears(model):
            logits = self.feed(prompt)
            tokens = list(prompt)
            for _ in range(max_new):
                state = SamplingState(self.params, torch.tensor([tokens], device=self.device))
                token = int(self.strategy.choose(process(logits, state, self.strategy.processors), self.generator)[0])
                tokens.append(token)
                stopped = text.push(token) or token in stops
                text.write()
                if stopped:
                    break
                logits = self.feed(tokens)
        return text.finish()

    def feed(self, ids: list[int]) -> torch.Tensor:
        """Bring the cache to hold `ids`; the (1, V) logits after the last of them."""
        model = self.run.model
        keep = common_prefix(self.cached, ids)
        if keep == len(ids):  # everything fed already: feed the last token again to get its logits
            keep -= 1
        if self.cache is not None and keep < self.cache.length and not self.cache.can_truncate(keep):
            self.cache = None  # (a sliding layer's ring no longer holds what a query at `keep` sees)
        if self.cache is None:  # sliding layers in rings: a long chat's memory grows with the global ones
            rolling = model.blocks[0].attn.window == 0 if hasattr(model, "blocks") else False
            self.cache, keep = model.new_cache(1, model.max_seq_len, rolling=rolling), 0
        elif keep < self.cache.length:
            self.cache.truncate(keep, ids[keep - 1] if keep else None)
        new = torch.tensor([ids[keep:]], device=self.device)
        if new.shape[1] == 1:  # one new token: the compiled step where enabled (--compile)
            logits = next_logits(model, new[:, 0], self.cache)
        else:
            logits = prompt_logits(model, new, self.cache)  # (1, V)
        self.cached = list(ids)
        return logits


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
