"""Text in, text out: the tokenizer around `generate`, with optional streaming."""
from __future__ import annotations

from typing import TextIO

import torch

from qkv.data.tokenizer import StreamDecoder
from qkv.generate.decode import generate
from qkv.run import Run


def generate_text(run: Run, prompt: str, *, max_new_tokens: int, strategy: str, temperature: float,
                  top_k: int, top_p: float, num_beams: int, seed: int, stream: TextIO | None = None) -> str:
    tokenizer = run.tokenizer
    device = next(run.model.parameters()).device
    input_ids = torch.tensor([[tokenizer.eos_id] + tokenizer.encode(prompt)], device=device)
    decoder = StreamDecoder(tokenizer)
    eos = tokenizer.eos_id

    def on_token(step: int, tokens: torch.Tensor) -> None:
        token = int(tokens[0])
        if stream is not None and token != eos:
            stream.write(decoder.push(token))
            stream.flush()

    if stream is not None:
        stream.write(prompt)
    ids = generate(run.model, input_ids, max_new_tokens=max_new_tokens, strategy=strategy,
                   temperature=temperature, top_k=top_k, top_p=top_p, num_beams=num_beams, seed=seed,
                   stop_tokens=(eos,), on_token=on_token if strategy != "beam" else None)
    new = [i for i in ids[0, input_ids.shape[1]:].tolist() if i != eos]
    if stream is not None:
        stream.write(decoder.flush() + "\n")
    return prompt + tokenizer.decode(new)
