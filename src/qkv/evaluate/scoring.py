"""`qkv eval`: score a run on its own validation split or on other text, with a sliding window."""
from __future__ import annotations

import math

import numpy as np

from qkv.data.corpus import join, read_documents
from qkv.data.sources import split
from qkv.errors import QkvError
from qkv.formats.base import Run
from qkv.evaluate.tokens import score_tokens


def text_tokens(run: Run, text: str) -> np.ndarray:
    """[start] + BPE(text) (start_id: end-of-text, or <bos>): the start lets the first real token be scored too."""
    return np.asarray([run.tokenizer.start_id] + run.tokenizer.encode(text), dtype=np.int64)


def score_run(run: Run, data_paths: list[str], stride: int | None = None) -> dict:
    if data_paths:
        text = join(read_documents(data_paths))
    else:
        text = join(split(run.config.data)[1])
    if not text:
        raise QkvError("nothing to score: the text is empty")
    context = run.config.model.max_seq_len
    stride = stride or max(1, context // 2)
    if stride > context:
        raise QkvError(f"--stride={stride} exceeds the model's context of {context} tokens")
    device = next(run.model.parameters()).device
    result = score_tokens(run.model, text_tokens(run, text), characters=len(text), seq_len=context,
                          stride=stride, device=device)
    size = len(text.encode("utf-8"))  # bits per byte: comparable across tokenizers and scripts (lm-eval's figure)
    result["bits_per_byte"] = result["loss"] * result["tokens"] / (math.log(2) * size)
    result["bytes"] = size
    return result
