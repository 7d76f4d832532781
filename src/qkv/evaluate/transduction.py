"""The held-out figures of a seq2seq run (train summary and `qkv eval`): chrF and exact-line accuracy of
the model's beam-search outputs, and of the copy-the-input baseline, on pairs of the validation text.

train.eval_batches x train.batch_size pairs (the number the validation loss sees; at most MAX_PAIRS), spread
evenly over the validation text's pairs (qkv.data.seq2seq.Seq2SeqBatches.pairs,
cut to train.seq_len as in training) are translated by beam search (BEAMS beams, length penalty 1, at most
train.seq_len new tokens, the tokenizer's end-of-text ending a line) and compared as text with their targets
(qkv.evaluate.chrf). The copy baseline outputs each source unchanged: for modern -> First Folio it is the
score of doing nothing, which a model has to beat to have learnt any spelling.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
import torch
from torch import nn

from qkv.data.corpus import read_documents
from qkv.data.dataset import encode_stream
from qkv.data.seq2seq import Pair, pad_right, seq2seq_batches
from qkv.data.tokenizer import PAD, Tokenizer
from qkv.errors import QkvError
from qkv.evaluate.chrf import chrf, exact
from qkv.data.sources import split
from qkv.generate import generate

MAX_PAIRS = 1000
BEAMS = 4
ROWS = 50  # sources per generate call


def held_out_pairs(tokens: np.ndarray, tokenizer: Tokenizer, cfg) -> list[Pair]:
    """(source, target) pairs of a token stream, evenly spread, cut as the training batches cut them."""
    sampler = seq2seq_batches(tokens, tokenizer, cfg, batch_size=1, seed=0)
    T, count = cfg.train.seq_len, min(MAX_PAIRS, cfg.train.eval_batches * cfg.train.batch_size)
    return [(src[:T], tgt[:T - 1]) for src, tgt in sampler.pairs(count)]


@torch.no_grad()
def translate(model: nn.Module, tokenizer: Tokenizer, sources: Sequence[np.ndarray], *, max_new_tokens: int,
              num_beams: int = BEAMS, device=None) -> list[list[int]]:
    """Each source's best beam-search output, without the start and end tokens."""
    device = device or next(model.parameters()).device
    eos, outputs = tokenizer.eos_id, []
    for first in range(0, len(sources), ROWS):
        src, src_mask = pad_right(sources[first:first + ROWS], tokenizer.special_id(PAD))  # (B, S) each
        ids = generate(model, torch.from_numpy(src).to(device), max_new_tokens, "beam", num_beams=num_beams,
                       attention_mask=torch.from_numpy(src_mask).to(device), decoder_start=eos,
                       stop_tokens=(eos,), pad_id=eos)  # (B, 1 + new)
        for row in ids[:, 1:].tolist():
            outputs.append(row[:row.index(eos)] if eos in row else row)
    return outputs


def score_pairs(model: nn.Module, tokenizer: Tokenizer, pairs: Sequence[Pair], *, max_new_tokens: int,
                device=None) -> dict:
    """chrF and exact-line accuracy of the model and of the copy baseline on `pairs`, and three examples."""
    if not pairs:
        raise QkvError("no (source, target) pair to score in the held-out text")
    sources = [tokenizer.decode(src.tolist()) for src, _ in pairs]
    targets = [tokenizer.decode(tgt.tolist()) for _, tgt in pairs]
    outputs = [tokenizer.decode(ids) for ids in translate(model, tokenizer, [src for src, _ in pairs],
                                                          max_new_tokens=max_new_tokens, device=device)]
    examples = {f"example {k + 1}": {"source": sources[i], "target": targets[i], "output": outputs[i]}
                for k, i in enumerate(sorted({0, len(pairs) // 2, len(pairs) - 1}))}
    return {"scored_pairs": len(pairs), "chrf": round(chrf(outputs, targets), 2),
            "exact_accuracy": round(exact(outputs, targets), 4), "copy_chrf": round(chrf(sources, targets), 2),
            "copy_exact_accuracy": round(exact(sources, targets), 4), **examples}


def max_new(cfg) -> int:
    return max(1, min(cfg.train.seq_len, cfg.model.max_seq_len - 1))


def report(trainer) -> dict:
    """The train summary's held-out figures (Objective.report): model and copy baseline, prefixed val_."""
    pairs = held_out_pairs(trainer.data.val, trainer.data.tokenizer, trainer.cfg)
    scores = score_pairs(trainer.model, trainer.data.tokenizer, pairs, max_new_tokens=max_new(trainer.cfg),
                         device=trainer.device)
    return {"val_pairs": scores["scored_pairs"], "val_chrf": scores["chrf"],
            "val_exact_accuracy": scores["exact_accuracy"], "copy_chrf": scores["copy_chrf"],
            "copy_exact_accuracy": scores["copy_exact_accuracy"]}


def evaluate_run(run, data_paths: list[str], stride: int | None) -> dict:
    """`qkv eval` on a seq2seq run: its validation split (or --data's pairs), as the train summary scores it."""
    if stride is not None:
        raise QkvError("--stride applies to language models; a seq2seq run is scored by translating its pairs")
    texts = [doc.text for doc in (read_documents(data_paths) if data_paths else split(run.config.data)[1])]
    tokens = encode_stream(run.tokenizer, texts)
    pairs = held_out_pairs(tokens, run.tokenizer, run.config)
    return score_pairs(run.model, run.tokenizer, pairs, max_new_tokens=max_new(run.config))
