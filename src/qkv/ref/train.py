"""Training with the reference engine: forward, hand-written backward, clipping, schedule and optimizer,
with no autograd anywhere (SPEC D). One step, as qkv.train.loop.Trainer.step:

    g = (1/k) sum over k micro-batches of d CE / d theta     (accumulation, LLM §10.4)
    g <- g * min(1, c / (||g||_2 + 1e-6))                     (clipping, LLM §4.3)
    theta <- optimizer(theta, g, lr(step))                    (AdamW by default, LLM §4.1 / §10.3)

lr(step) is qkv.schedules.SCHEDULES[train.schedule] with total = `steps`; for "cosine":
    lr * (step + 1) / warmup                                          for step < warmup
    min_lr + 0.5 (lr - min_lr) (1 + cos(pi * min(1, (step - warmup) / max(1, steps - 1 - warmup))))   after.
"""
from __future__ import annotations

from typing import Callable, Iterable

import numpy as np

from qkv.ref.model import loss_and_grads
from qkv.ref.optim import OPTIMIZERS, clip_grad_norm
from qkv.schedules import schedule_of


def unpack_batch(batch) -> tuple:
    """A batch of any objective (qkv.train.objectives) -> (inputs, attention_mask, targets) in the convention
    of loss_and_grads: LM and MLM batches are (inputs, targets); seq2seq batches are
    (src, src_mask, tgt_in, tgt_mask, labels) -> ((src, tgt_in), (src_mask, tgt_mask), labels)."""
    arrays = tuple(np.asarray(a) for a in batch)
    if len(arrays) == 5:
        src, src_mask, tgt_in, tgt_mask, labels = arrays
        return (src, tgt_in), (src_mask, tgt_mask), labels
    inputs, targets = arrays
    return inputs, None, targets


def split_rows(value, k: int) -> list:
    """k micro-batches along the batch axis of an array, a tuple of arrays, or None."""
    if value is None:
        return [None] * k
    if isinstance(value, tuple):
        return list(zip(*(np.array_split(a, k) for a in value)))
    return np.array_split(value, k)


def train_step(params: dict, model_cfg, train_cfg, optimizer, inputs, targets: np.ndarray,
               lr: float, attention_mask=None) -> tuple[float, float]:
    """One optimizer update over `train_cfg.accumulation` micro-batches; returns (loss, grad norm)."""
    k = train_cfg.accumulation
    total_loss, total_grads = 0.0, {}
    for x, mask, y in zip(split_rows(inputs, k), split_rows(attention_mask, k), split_rows(targets, k)):
        loss, grads, _ = loss_and_grads(params, model_cfg, x, y, attention_mask=mask,
                                        label_smoothing=train_cfg.label_smoothing,
                                        aux_weight=train_cfg.aux_loss_weight if model_cfg.moe_experts else 0.0)
        total_loss += loss / k
        for name, g in grads.items():
            total_grads[name] = total_grads.get(name, 0.0) + g / k
    norm = clip_grad_norm(total_grads, train_cfg.grad_clip)
    optimizer.step(params, total_grads, lr)
    return total_loss, norm


def learning_rate(train_cfg, step: int, total: int, d_model: int) -> float:
    return schedule_of(train_cfg)(step, lr=train_cfg.lr, min_lr=train_cfg.min_lr,
                                warmup=train_cfg.warmup_steps, total=total, d_model=d_model)


def train_ref(params: dict, cfg, batches: Iterable, steps: int,
              on_step: Callable[[int, float, float, float], None] | None = None) -> list[float]:
    """Train `params` (a dict of float64 arrays, updated in place) for `steps` optimizer updates.

    cfg: a RunConfig (model + train sections are used); batches: an iterable of batches of any objective
    (`unpack_batch`); on_step(step, loss, grad_norm, lr) after every update.
    Returns the loss of every step."""
    optimizer = OPTIMIZERS.get(cfg.train.optimizer)(cfg.train)
    losses = []
    for step, batch in zip(range(steps), batches):
        lr = learning_rate(cfg.train, step, steps, cfg.model.d_model)
        inputs, mask, targets = unpack_batch(batch)
        loss, norm = train_step(params, cfg.model, cfg.train, optimizer, inputs, targets, lr, attention_mask=mask)
        losses.append(loss)
        if on_step is not None:
            on_step(step, loss, norm, lr)
    return losses
