"""`qkv eval RUN`: one evaluator per training objective, looked up by the run's objective name.

Every evaluator has one signature: (run, data_paths, stride) -> dict of figures (JSON values).
- lm:       loss, perplexity and bits per character over the whole text with a sliding window (scoring.py)
- mlm:      masked-token loss and accuracy over the held-out text, masked once with a fixed seed
- seq2seq:  chrF and exact-line accuracy of beam search and of the copy-the-input baseline on held-out pairs
- classify: passage and whole-work accuracy and the confusion matrix on the genre split's validation and test
            plays, with the bag-of-words baseline and the majority-class rate
"""
from __future__ import annotations

import math
from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F

from qkv.data.corpus import join, read_documents
from qkv.data.mlm import IGNORE, mask_tokens
from qkv.data.sources import split
from qkv.data.tokenizer import MASK
from qkv.errors import QkvError
from qkv.registry import Registry
from qkv.evaluate.classify import check_data, score_model
from qkv.formats.base import Run
from qkv.models.build import use_of
from qkv.evaluate.scoring import score_run
from qkv.evaluate.transduction import evaluate_run

EVALUATORS: Registry[Callable[[Run, list[str], int | None], dict]] = Registry("evaluator")
MLM_EVAL_SEED = 0  # the masks of `qkv eval` on an MLM run: the same at every call


def evaluate(run: Run, data_paths: list[str], stride: int | None = None) -> dict:
    return EVALUATORS.get(use_of(run.config))(run, data_paths, stride)


@EVALUATORS.register("lm")
def lm(run: Run, data_paths: list[str], stride: int | None) -> dict:
    return score_run(run, data_paths, stride)


def held_out_text(run: Run, data_paths: list[str]) -> str:
    text = join(read_documents(data_paths)) if data_paths else join(split(run.config.data)[1])
    if not text.strip():
        raise QkvError("nothing to score: the text is empty")
    return text


@EVALUATORS.register("mlm")
def mlm(run: Run, data_paths: list[str], stride: int | None) -> dict:
    """Every non-overlapping window of train.seq_len tokens, masked as in training (mask_prob, 80/10/10) with
    a fixed seed; loss and accuracy of the original token over the chosen positions."""
    if stride is not None:
        raise QkvError("--stride applies to language models; an MLM run is scored on non-overlapping windows")
    ids = np.asarray(run.tokenizer.encode(held_out_text(run, data_paths)), dtype=np.int64)
    T = min(run.config.train.seq_len, run.config.model.max_seq_len)
    if len(ids) < T:
        raise QkvError(f"the text has {len(ids)} tokens, fewer than one window of train.seq_len={T}")
    windows = ids[: len(ids) // T * T].reshape(-1, T)  # (N, T)
    inputs, targets = mask_tokens(windows, np.random.default_rng(MLM_EVAL_SEED), mask_prob=run.config.train.mask_prob,
                                  mask_id=run.tokenizer.special_id(MASK), n_regular=run.tokenizer.trained_size)
    device = next(run.model.parameters()).device
    nats, right, count = 0.0, 0, 0
    with torch.no_grad():
        for i in range(0, len(inputs), 32):
            x, y = (torch.as_tensor(a[i:i + 32], device=device) for a in (inputs, targets))
            logits = run.model(x).float()  # (b, T, V)
            nats += F.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=IGNORE, reduction="sum").item()
            chosen = y != IGNORE
            right += (logits.argmax(-1)[chosen] == y[chosen]).sum().item()
            count += chosen.sum().item()
    loss = nats / count
    return {"masked_loss": loss, "masked_perplexity": math.exp(loss), "masked_accuracy": right / count,
            "masked_tokens": count, "windows": len(inputs)}


@EVALUATORS.register("seq2seq")
def seq2seq(run: Run, data_paths: list[str], stride: int | None) -> dict:
    """chrF and exact-line accuracy of beam search and of the copy baseline on held-out pairs (transduction.py)."""
    return evaluate_run(run, data_paths, stride)


@EVALUATORS.register("classify")
def classify(run: Run, data_paths: list[str], stride: int | None) -> dict:
    if data_paths or stride is not None:
        raise QkvError("a classify run is scored on its own held-out plays; --data and --stride do not apply")
    check_data(run.config)
    device = next(run.model.parameters()).device
    return score_model(run.model, run.tokenizer, run.config.train.seq_len, device)


def describe(result: dict, indent: str = "") -> str:
    """Figures one per line; nested figures (validation, test, baseline) indented under their name."""
    lines = []
    for key, value in result.items():
        if isinstance(value, dict):
            lines += [f"{indent}{key:>14}:", describe(value, indent + "  ")]
        elif isinstance(value, float):
            lines.append(f"{indent}{key:>14}: {value:.4f}")
        else:
            lines.append(f"{indent}{key:>14}: {value}")
    return "\n".join(lines)
