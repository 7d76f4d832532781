"""Multiple choice by log-likelihood (`qkv eval RUN --task FILE.jsonl`), the way lm-evaluation-harness scores its
multiple_choice tasks. Rows {"context": text, "choices": [text, ...], "gold": index}; for each choice a_i,

    ll_i = sum_t log p(a_i,t | context, a_i,<t)            (the continuation's tokens only)
    acc = mean_rows [argmax_i ll_i == gold]
    acc_norm = mean_rows [argmax_i ll_i / len(a_i) == gold]  (len in characters, as the harness counts)
    stderr(acc) = s / sqrt(n),  s the sample standard deviation of the 0/1 outcomes (the harness's mean_stderr)

The continuation's tokens are those of encode(context + a_i) after the tokens of encode(context), a trailing space
of the context moved to the continuation first (the harness's _encode_pair), so a word keeps its leading-space
token. A context longer than the model's window keeps its last tokens.
"""
from __future__ import annotations

import math

import numpy as np
import torch

from qkv.data.cloze import cloze_rows
from qkv.data.corpus import read_json_rows
from qkv.errors import QkvError
from qkv.formats.base import Run


BUILT_IN = {"shakespeare-cloze": cloze_rows}  # tasks qkv ships, built from the bundled corpus (qkv.data.cloze)


def read_task(path: str) -> list[tuple[str, str, list[str], int]]:
    """A task's rows: a .jsonl(.gz) file, or the name of a task qkv ships (BUILT_IN)."""
    if path in BUILT_IN:
        records = [(f"{path}:{k + 1}", row) for k, row in enumerate(BUILT_IN[path]())]
    else:
        records = read_json_rows(path)
    rows = []
    for origin, record in records:
        context, choices, gold = record.get("context"), record.get("choices"), record.get("gold")
        if not isinstance(context, str) or not isinstance(choices, list) or len(choices) < 2 \
                or not all(isinstance(c, str) and c for c in choices):
            raise QkvError(f"{origin}: expected {{\"context\": text, \"choices\": [two or more non-empty texts], "
                           "\"gold\": index}")
        if not isinstance(gold, int) or isinstance(gold, bool) or not 0 <= gold < len(choices):
            raise QkvError(f"{origin}: gold={gold!r} must be an index into the {len(choices)} choices")
        rows.append((origin, context, choices, gold))
    if not rows:
        raise QkvError(f"{path}: no rows")
    return rows


def encode_pair(tokenizer, context: str, continuation: str) -> tuple[list[int], list[int]]:
    spaces = len(context) - len(context.rstrip(" "))
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole, start = tokenizer.encode(context + continuation), tokenizer.encode(context)
    return start, whole[len(start):]


@torch.no_grad()
def choice_scores(run: Run, rows) -> list[np.ndarray]:
    """Each row's ll_i (nats), one per choice: a row's choices in one forward, right-padded (a causal model's
    outputs at a position never see the positions after it, so the padding changes nothing)."""
    model, tokenizer = run.model.eval(), run.tokenizer
    device = next(model.parameters()).device
    window = run.config.model.max_seq_len
    out = []
    for _, context, choices, _ in rows:
        sequences, counts = [], []
        for choice in choices:
            context_ids, continuation_ids = encode_pair(tokenizer, context, choice)
            if not continuation_ids:
                raise QkvError("a choice encodes to no tokens")
            context_ids = context_ids or [tokenizer.start_id]  # an empty context: the start-of-text token
            sequences.append((context_ids + continuation_ids)[-(window + 1):])
            counts.append(len(continuation_ids))
        width = max(len(ids) for ids in sequences) - 1
        x = torch.tensor([ids[:-1] + [tokenizer.eos_id] * (width + 1 - len(ids)) for ids in sequences], device=device)
        logprobs = model(x).float().log_softmax(-1)  # (choices, width, V)
        scores = []
        for i, (ids, n) in enumerate(zip(sequences, counts)):
            end = len(ids) - 1  # positions 0 .. end - 1 predict ids[1:]
            targets = torch.tensor(ids[-n:], device=device)
            scores.append(logprobs[i, end - n:end].gather(-1, targets[:, None]).sum().item())
        out.append(np.array(scores))
    return out


def evaluate_task(run: Run, path: str) -> dict:
    rows = read_task(path)
    hits, hits_norm = [], []
    for (_, _, choices, gold), scores in zip(rows, choice_scores(run, rows)):
        hits.append(float(np.argmax(scores) == gold))
        hits_norm.append(float(np.argmax(scores / np.array([len(c) for c in choices])) == gold))
    return {"task": path, "rows": len(rows), "acc": float(np.mean(hits)), "acc_stderr": stderr(hits),
            "acc_norm": float(np.mean(hits_norm)), "acc_norm_stderr": stderr(hits_norm),
            "chance": float(np.mean([1 / len(choices) for _, _, choices, _ in rows]))}


def stderr(values: list[float]) -> float:
    n = len(values)
    if n < 2:
        return float("nan")
    return float(np.std(values, ddof=1) / math.sqrt(n))
