"""The classify objective (docs/tasks.md "Genre classification"): an encoder with a classifier head trained
with cross-entropy over the labels of passages (note 000 §13.2); scored by qkv.evaluate.classify.

    logits = head(pool(Encoder(x)))     (B, C)        (qkv.models.heads.EncoderClassifier)
    loss   = -(1/B) sum_b log softmax(logits_b)[y_b]

Data: qkv.data.genres (the bundled plays labelled comedy / history / tragedy, split by whole works).
"""
from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn

from qkv.data import genres
from qkv.data.dataset import Prepared, default_cache_dir, prepare
from qkv.data.tokenizer import Tokenizer
from qkv.errors import QkvError
from qkv.evaluate.classify import check_data


def prepare_passages(cfg, tokenizer: Tokenizer | None, chat=None) -> Prepared:
    """Tokenizer (trained on the training plays unless given) and the train / validation passages."""
    check_data(cfg)
    train, val, _ = genres.bundled_split()
    if tokenizer is None:  # the BPE of the training plays, from the content-hash cache when present
        tokenizer = prepare([w.text for w in train], [w.text for w in val], cfg.data.vocab_size,
                            default_cache_dir()).tokenizer
    return Prepared(tokenizer=tokenizer, train=genres.encode_works(train, tokenizer),
                    val=genres.encode_works(val, tokenizer), val_chars=sum(len(w.text) for w in val),
                    cache_dir=default_cache_dir())


def batches(passages, tokenizer: Tokenizer | None, cfg, *, batch_size: int, seed: int) -> genres.PassageBatches:
    if not isinstance(passages, genres.Passages):
        raise QkvError("train.objective='classify' trains on labelled passages (qkv.data.genres), not a token stream")
    return genres.PassageBatches(passages, cfg.train.seq_len, batch_size, seed)


def loss(model: nn.Module, batch: tuple[Tensor, ...], label_smoothing: float) -> Tensor:
    inputs, labels = batch  # (B, T), (B,)
    return F.cross_entropy(model(inputs).float(), labels, label_smoothing=label_smoothing)
