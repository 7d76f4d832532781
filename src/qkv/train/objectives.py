"""Training objectives (SPEC B1, B10): where an objective's batches come from and the loss of a model on one.

Every objective has one signature:
    batches(tokens, tokenizer, cfg, *, batch_size, seed) -> sampler with next() -> tuple of (B, ...) arrays,
                                                           state() -> JSON and load_state(state)
    loss(model, batch, label_smoothing) -> scalar mean cross-entropy over the predicted tokens

- lm:      next-token prediction on random windows (note 000 §13.1): CE(model(x), x shifted by one)
- mlm:     BERT's masked LM on random windows (qkv.data.mlm): CE over the masked positions only
- seq2seq: teacher forcing on (source, target) line pairs (qkv.data.seq2seq): CE(model(src, tgt_in), labels)
- classify: labelled passages (qkv.data.genres, qkv.train.classify): CE(model(x), label), one label per row
- sft:     conversations packed with document masks (qkv.train.sft): CE over the assistant's tokens only
- dpo:     preference pairs (qkv.train.dpo): -log sigma(beta (log-ratio of chosen - log-ratio of rejected))

`train.objective = auto` takes the architecture's own: decoder -> lm, encoder -> mlm, encoder-decoder -> seq2seq.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch
from torch import Tensor, nn

from qkv.data.dataset import Batches
from qkv.data.mlm import MLMBatches
from qkv.data.seq2seq import seq2seq_batches
from qkv.data.tokenizer import MASK, PAD, Tokenizer, needs_tokenizer
from qkv.errors import QkvError
from qkv.models.build import objective_of
from qkv.nn.fastpath import has_hooks
from qkv.nn.linear_cross_entropy import cross_entropy, head_cross_entropy, target_rows
from qkv.registry import Registry
from qkv.evaluate import classify as classify_figures, transduction
from qkv.train import classify, dpo, sft
from qkv.parallel.layout import unwrapped
from qkv.data.sources import prepare_data

def token_streams(cfg, tokenizer: Tokenizer | None, chat=None):
    """The data of the token-stream objectives: qkv.data.sources.prepare_data (a fixed tokenizer or a trained one)."""
    return prepare_data(cfg.data, tokenizer=tokenizer)


@dataclass(frozen=True)
class Objective:
    batches: Callable[..., object]
    loss: Callable[[nn.Module, tuple[Tensor, ...], float], Tensor]
    model: tuple[str, str]  # the (model.arch, model.head) it trains
    specials: tuple[str, ...] = ()  # tokens added to the tokenizer after its trained vocabulary
    # (RunConfig, Tokenizer | None, Chat | None) -> data.dataset.Prepared; the chat: how the init model chats
    prepare: Callable[..., object] = token_streams
    report: Callable[..., dict] | None = None  # (Trainer) -> held-out figures for the train summary
    cuts_columns: bool = False  # batches of position-wise (B, T) arrays: train.seq_warmup_steps may cut them
    setup: Callable[..., None] | None = None  # (Trainer, resume) before the first step (DPO's reference)
    recorder: object | None = None  # take() -> {name: tensor}: statistics the loss records, logged each step


OBJECTIVES: Registry[Objective] = Registry("objective")


def lm_batches(tokens: np.ndarray, tokenizer: Tokenizer | None, cfg, *, batch_size: int, seed: int) -> Batches:
    return Batches(tokens, cfg.train.seq_len, batch_size, seed)


def lm_loss(model: nn.Module, batch: tuple[Tensor, ...], label_smoothing: float) -> Tensor:
    inputs, targets = batch  # (B, T) each
    hidden = model(inputs, head=False)  # final_norm(H_L) (B, T, D), through the layout's wrapper
    return head_cross_entropy(unwrapped(model).lm_head, hidden, targets, label_smoothing)  # in row chunks


def mlm_batches(tokens: np.ndarray, tokenizer: Tokenizer | None, cfg, *, batch_size: int, seed: int) -> MLMBatches:
    mask_id = needs_tokenizer(tokenizer, "mlm").special_id(MASK)
    return MLMBatches(tokens, cfg.train.seq_len, batch_size, seed, mask_id=mask_id,
                      n_regular=tokenizer.trained_size,
                      mask_prob=cfg.train.mask_prob)


def mlm_loss(model: nn.Module, batch: tuple[Tensor, ...], label_smoothing: float) -> Tensor:
    inputs, targets = batch  # (B, T) each; targets -100 except at the chosen positions
    hidden, head = model(inputs, head=False), unwrapped(model).head  # (B, T, D), the MLM head
    if has_hooks(head):  # its hooks see the whole (B, T, V) logits
        return cross_entropy(head(hidden), targets, label_smoothing)
    hidden, targets = target_rows(hidden, targets)  # (n, D), (n,): the head on the masked positions only
    return head_cross_entropy(head.decoder, head.features(hidden), targets, label_smoothing)


def seq2seq_loss(model: nn.Module, batch: tuple[Tensor, ...], label_smoothing: float) -> Tensor:
    src, src_mask, tgt_in, tgt_mask, labels = batch  # (B, S), (B, S), (B, T), (B, T), (B, T)
    hidden, lm_head = model(src, tgt_in, src_mask, tgt_mask, head=False), unwrapped(model).lm_head  # (B, T, D)
    if not has_hooks(lm_head):  # (a hooked head's hooks see every position's logits)
        hidden, labels = target_rows(hidden, labels)  # (n, D), (n,): padding needs no logits
    return head_cross_entropy(lm_head, hidden, labels, label_smoothing)


OBJECTIVES.register("lm")(Objective(lm_batches, lm_loss, ("decoder", "none"), cuts_columns=True))
OBJECTIVES.register("mlm")(Objective(mlm_batches, mlm_loss, ("encoder", "mlm"), specials=(MASK,), cuts_columns=True))
OBJECTIVES.register("seq2seq")(Objective(seq2seq_batches, seq2seq_loss, ("encoder-decoder", "none"),
                                         specials=(PAD,), report=transduction.report))
OBJECTIVES.register("classify")(Objective(classify.batches, classify.loss, ("encoder", "classifier"),
                                          prepare=classify.prepare_passages, report=classify_figures.report))

OBJECTIVES.register("sft")(Objective(sft.batches, sft.loss, ("decoder", "none"), prepare=sft.prepare))
OBJECTIVES.register("dpo")(Objective(dpo.batches, dpo.loss, ("decoder", "none"), prepare=dpo.prepare, setup=dpo.setup,
                                     recorder=dpo.RECORDER, report=dpo.report))


def for_run(cfg) -> Objective:
    """The objective of a RunConfig, checked against its model."""
    name = objective_of(cfg)
    objective = OBJECTIVES.get(name)
    arch, head = objective.model
    if (cfg.model.arch, cfg.model.head) != (arch, head):
        raise QkvError(f"train.objective={name!r} trains model.arch={arch!r} with model.head={head!r}; this run "
                       f"has model.arch={cfg.model.arch!r}, model.head={cfg.model.head!r}")
    if cfg.train.seq_warmup_steps and not objective.cuts_columns:
        raise QkvError(f"train.seq_warmup_steps={cfg.train.seq_warmup_steps}: train.objective={name!r} has no "
                       f"position-wise batches to shorten; the sequence-length warmup needs lm or mlm")
    return objective


@torch.no_grad()
def evaluate(objective: Objective, model: nn.Module, tokens: np.ndarray, tokenizer: Tokenizer | None, cfg, *,
             batch_size: int, batches: int, seed: int, device, loss: Callable | None = None) -> float:
    """Mean loss (no label smoothing) over `batches` fixed batches drawn with `seed` (the same at every call);
    `loss`: in place of the objective's (a pipeline's stages compute theirs)."""
    loss = loss or objective.loss
    was_training = model.training
    model.eval()
    sampler = objective.batches(tokens, tokenizer, cfg, batch_size=batch_size, seed=seed)
    losses = []
    for _ in range(batches):
        batch = tuple(torch.from_numpy(a).to(device) for a in sampler.next())
        losses.append(loss(model, batch, 0.0).item())
    model.train(was_training)
    return float(np.mean(losses))
