"""Text in, text out: the tokenizer around `generate`, with optional streaming and stop strings.

Stop strings: generation stops after the first step whose decoded continuation contains any of
`stop_strings`, and the returned (and streamed) text ends just before the earliest occurrence: the stop
string itself is not part of the output. Streaming holds back the last len(longest stop string) - 1
characters until they can no longer begin a stop string, so nothing past the cut is ever printed.
Beam search settles its tokens only at the end: there the text is cut after the fact, without stopping
early, and streamed once complete.
"""
from __future__ import annotations

from typing import Sequence, TextIO

import torch

from qkv.data.tokenizer import StreamDecoder, Tokenizer
from qkv.errors import QkvError
from qkv.generate.decode import generate
from qkv.models.build import architecture_of
from qkv.formats.base import Run


class TextStream:
    """The decoded continuation of one row, cut at the first stop string and streamed without passing it."""

    def __init__(self, tokenizer: Tokenizer, stop_strings: Sequence[str], stream: TextIO | None,
                 stop_ids: Sequence[int] = ()):
        self.decoder, self.ends = StreamDecoder(tokenizer), {tokenizer.eos_id, *stop_ids}  # never shown
        self.stop_strings = tuple(s for s in stop_strings if s)
        self.hold = max((len(s) for s in self.stop_strings), default=1) - 1  # chars that may start a stop string
        self.stream, self.text, self.written, self.cut = stream, "", 0, None

    def push(self, token: int) -> bool:
        """Add one token; True once the text contains a stop string."""
        if self.cut is None and token not in self.ends:
            self.text += self.decoder.push(token)
            self.find_cut()
        return self.cut is not None

    def stop_if(self, new: torch.Tensor) -> torch.Tensor:
        """generate's stop_if for a batch of one: (1, n) new tokens -> (1,) bool."""
        return torch.tensor([self.push(int(new[0, -1]))])

    def find_cut(self) -> None:
        found = [i for i in (self.text.find(s) for s in self.stop_strings) if i >= 0]
        self.cut = min(found) if found else None

    def write(self, final: bool = False) -> None:
        """Stream what is settled: up to the cut, else all but the held-back tail (everything when final)."""
        end = self.cut if self.cut is not None else len(self.text) - (0 if final else self.hold)
        if self.stream is not None and end > self.written:
            self.stream.write(self.text[self.written:end])
            self.stream.flush()
            self.written = end

    def finish(self) -> str:
        if self.cut is None:
            self.text += self.decoder.flush()
            self.find_cut()
        self.write(final=True)
        return self.text[:self.cut]


def start_of(tokenizer, prompt: str) -> list[int]:
    """What a language model continues: [start] + the prompt; with no prompt, [start] + a line break. The start
    is the tokenizer's start_id: its end-of-text token, or the <bos> its model file asks for (Gemma). End-of-text alone is a poor start: training sees it once a document (the default job's corpus: a
    few dozen times in 300 s), so what a small model puts after it is noise ('IOLAN@@@@' after the default
    job), while a line break, seen thousands of times, is followed by what the text's lines begin with."""
    return [tokenizer.start_id] + tokenizer.encode(prompt or "\n")


def generate_text(run: Run, prompt: str, *, max_new_tokens: int, strategy: str, temperature: float,
                  top_k: int, top_p: float, num_beams: int, seed: int, stream: TextIO | None = None,
                  stop_strings: Sequence[str] = ()) -> str:
    """A language model's prompt + continuation, or an encoder-decoder's output for the prompt as its source;
    cut before the first of `stop_strings` (module docstring)."""
    tokenizer = run.tokenizer
    device = next(run.model.parameters()).device
    # a language model continues [end-of-text] + prompt; an encoder-decoder reads the prompt as its source
    # and writes a new text from the start token, exactly as the seq2seq objective trains it
    seq2seq = architecture_of(run.model).prompt == "source"
    source = tokenizer.encode(prompt) if seq2seq else start_of(tokenizer, prompt)
    if not source:
        raise QkvError("an encoder-decoder needs a non-empty --prompt: it is the source text")
    input_ids = torch.tensor([source], device=device)
    start = {"decoder_start": tokenizer.eos_id} if seq2seq else {}
    prefix = "" if seq2seq else prompt
    new_from = 1 if seq2seq else input_ids.shape[1]  # the line break of an empty prompt is not printed
    text = TextStream(tokenizer, stop_strings, stream, run.stop_ids)
    stepwise = strategy != "beam"
    stop_if = text.stop_if if stepwise and text.stop_strings else None  # stop_if pushes each new token

    def on_token(step: int, tokens: torch.Tensor) -> None:
        if stop_if is None:
            text.push(int(tokens[0]))
        text.write()

    if stream is not None:
        stream.write(prefix)
    ids = generate(run.model, input_ids, max_new_tokens=max_new_tokens, strategy=strategy,
                   temperature=temperature, top_k=top_k, top_p=top_p, num_beams=num_beams, seed=seed,
                   stop_tokens=run.stop_ids, on_token=on_token if stepwise else None, stop_if=stop_if,
                   **start)
    for token in ids[0, new_from:].tolist() if not stepwise else ():  # beam: settled at the end
        if text.push(token):
            break
    continuation = text.finish()
    if stream is not None:
        stream.write("\n")
    return prefix + continuation
