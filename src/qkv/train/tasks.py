"""`qkv train --task NAME`: a task turns a preset into the run that does one job (the data, the objective and
the head it needs). `--task` without `--preset` starts from the task's own preset. docs/tasks.md."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable

from qkv.config import RunConfig
from qkv.registry import Registry
from qkv.data.genres import LABELS


@dataclass(frozen=True)
class Task:
    preset: str  # the preset used when no --preset is given
    apply: Callable[[RunConfig], RunConfig]
    summary: str  # one line for --help and the docs


TASKS: Registry[Task] = Registry("task")


def genre_classification(cfg: RunConfig) -> RunConfig:
    """An encoder with a fresh 3-way classifier head on mean-pooled states, fine-tuned on the genre split's
    training plays (qkv.data.genres) for 3 minutes."""
    model = dataclasses.replace(cfg.model, head="classifier", n_classes=len(LABELS), labels=LABELS,
                                pooling="mean", dropout=0.1)
    # fine-tuning keeps AdamW with cosine decay (the pretraining preset's Muon and WSD are not measured here)
    train = dataclasses.replace(cfg.train, objective="classify", batch_size=16, seq_len=128, max_steps=100_000,
                                max_time=180.0, optimizer="adamw", lr=5e-4, min_lr=2e-5, schedule="cosine",
                                decay_shape="linear", warmup_steps=30, weight_decay=0.01, eval_batches=8,
                                label_smoothing=0.0)
    data = dataclasses.replace(cfg.data, split="genre", spelling="modern")
    return dataclasses.replace(cfg, model=model, train=train, data=data)


TASKS.register("classify")(Task("bert-shakespeare", genre_classification,
                                "genre classification (comedy / history / tragedy) of passages of the plays"))


def supervised_fine_tuning(cfg: RunConfig) -> RunConfig:
    """Chat SFT of an --init model (its sizes, tokenizer and chat template) on --data FILE.jsonl (qkv.train.sft):
    AdamW at a fine-tuning rate with a short warmup and cosine decay, no weight decay, packed rows of 256 tokens,
    bf16 where the CPU multiplies it natively; 10 minutes or 200 steps."""
    train = dataclasses.replace(cfg.train, objective="sft", batch_size=8, seq_len=256, max_steps=200, max_time=600.0,
                                optimizer="adamw", lr=1e-4, min_lr=1e-5, schedule="cosine", decay_shape="linear",
                                warmup_steps=10, weight_decay=0.0, eval_batches=4, label_smoothing=0.0,
                                precision="auto", seq_warmup_steps=0, batch_warmup_steps=0)
    return dataclasses.replace(cfg, train=train)


TASKS.register("sft")(Task("shakespeare", supervised_fine_tuning,
                           "chat SFT of --init RUN_OR_GGUF on --data FILE.jsonl (messages or prompt/completion rows)"))


def preference_tuning(cfg: RunConfig) -> RunConfig:
    """DPO of an --init model on --data PAIRS.jsonl ({"prompt", "chosen", "rejected"}; qkv.train.dpo): beta 0.1,
    a small learning rate (the reference is the init itself), pairs of up to 256 tokens a side."""
    train = dataclasses.replace(cfg.train, objective="dpo", batch_size=8, seq_len=256, max_steps=100, max_time=600.0,
                                optimizer="adamw", lr=5e-6, min_lr=5e-7, schedule="cosine", decay_shape="linear",
                                warmup_steps=5, weight_decay=0.0, eval_batches=4, label_smoothing=0.0, precision="auto",
                                seq_warmup_steps=0, batch_warmup_steps=0, dpo_beta=0.1)
    return dataclasses.replace(cfg, train=train)


TASKS.register("dpo")(Task("shakespeare", preference_tuning,
                           "DPO of --init RUN_OR_GGUF on --data PAIRS.jsonl (prompt, chosen, rejected rows)"))
