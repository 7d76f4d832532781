"""Held-out scoring: validation loss on random windows, and bits per character over a whole text.

bits/char = (total cross-entropy in nats over the scored tokens) / (ln 2 * characters of the text):
a tokenizer-independent measure, so BPE and character-level models compare.
"""
from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from qkv.data.dataset import Batches, eval_windows


@torch.no_grad()
def val_loss(model: nn.Module, tokens: np.ndarray, *, seq_len: int, batch_size: int, batches: int,
             seed: int, device) -> float:
    """Mean cross-entropy over `batches` fixed random windows (the same windows at every call)."""
    was_training = model.training
    model.eval()
    sampler = Batches(tokens, seq_len, batch_size, seed)
    losses = []
    for _ in range(batches):
        inputs, targets = (torch.from_numpy(a).to(device) for a in sampler.next())
        logits = model(inputs)
        losses.append(F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten()).item())
    model.train(was_training)
    return float(np.mean(losses))


@torch.no_grad()
def score_tokens(model: nn.Module, tokens: np.ndarray, *, characters: int, seq_len: int,
                 stride: int, device, batch_size: int = 8) -> dict:
    """Score every token after the first with a sliding window of up to `seq_len` tokens of context."""
    was_training = model.training
    model.eval()
    total_nats, scored = 0.0, 0
    windows = list(eval_windows(tokens, seq_len, stride))
    for group in _same_length_groups(windows, batch_size):
        x = torch.as_tensor(np.stack([w[0] for w in group]), dtype=torch.long, device=device)  # (b, T)
        y = torch.as_tensor(np.stack([w[1] for w in group]), dtype=torch.long, device=device)  # (b, T)
        logits = model(x).float()  # (b, T, V)
        for row, (_, targets, score_from) in enumerate(group):
            total_nats += F.cross_entropy(logits[row, score_from:], y[row, score_from:], reduction="sum").item()
            scored += len(targets) - score_from
    model.train(was_training)
    loss = total_nats / max(1, scored)
    return {"loss": loss, "perplexity": math.exp(loss), "bits_per_char": total_nats / (math.log(2) * characters),
            "tokens": scored, "characters": characters}


def _same_length_groups(windows: list, batch_size: int):
    group: list = []
    for window in windows:
        if group and (len(group) == batch_size or len(window[0]) != len(group[0][0])):
            yield group
            group = []
        group.append(window)
    if group:
        yield group
