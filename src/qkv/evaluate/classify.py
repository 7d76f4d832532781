"""A classifier's figures (docs/tasks.md "Genre classification"): accuracy on held-out works beside a
bag-of-words baseline and the majority class, and the labels of one text (`qkv classify`)."""
from __future__ import annotations

import numpy as np
import torch
from torch import nn

from qkv.data import genres
from qkv.data.tokenizer import Tokenizer
from qkv.errors import QkvError
from qkv.evaluate.baselines import BowClassifier, majority_rate


def check_data(cfg) -> None:
    if cfg.data.paths:
        raise QkvError("train.objective='classify' reads the bundled plays (qkv.data.genres); data.paths "
                       f"must be empty, got {', '.join(cfg.data.paths)}")


@torch.no_grad()
def probabilities(model: nn.Module, ids: np.ndarray, device, batch_size: int = 64) -> np.ndarray:
    """softmax(model(ids)) for ids (N, T): (N, C) float64."""
    was_training = model.training
    model.eval()
    out = [torch.softmax(model(torch.as_tensor(ids[i:i + batch_size], device=device)).double(), dim=-1).cpu()
           for i in range(0, len(ids), batch_size)]
    model.train(was_training)
    return torch.cat(out).numpy() if out else np.zeros((0, 0))


def accuracy_report(probs: np.ndarray, labels: np.ndarray, works: np.ndarray, label_names) -> dict:
    """Passage accuracy, the confusion matrix (rows: true label, columns: predicted) and the accuracy of
    labelling each whole work by its passages' mean probability."""
    predicted = probs.argmax(axis=1)
    C = len(label_names)
    confusion = np.zeros((C, C), dtype=np.int64)
    np.add.at(confusion, (labels, predicted), 1)
    work_ids = np.unique(works)
    work_right = [probs[works == w].mean(axis=0).argmax() == labels[works == w][0] for w in work_ids]
    return {"accuracy": float((predicted == labels).mean()), "passages": int(len(labels)),
            "work_accuracy": float(np.mean(work_right)), "works": int(len(work_ids)),
            "labels": list(label_names), "confusion": confusion.tolist()}


def score_model(model: nn.Module, tokenizer: Tokenizer, seq_len: int, device, *, baseline: bool = True) -> dict:
    """Validation and test accuracy of `model`; with `baseline`, the bag-of-words baseline's and the
    majority-class rate on the same test passages."""
    train, val, test = (genres.encode_works(part, tokenizer) for part in genres.bundled_split())
    result = {}
    for name, passages in (("val", val), ("test", test)):
        ids, labels, works = passages.windows(seq_len)
        result[name] = accuracy_report(probabilities(model, ids, device), labels, works, passages.label_names)
    if baseline:
        result["baseline"] = baseline_scores(train, test, tokenizer, seq_len)
    return result


def baseline_scores(train: genres.Passages, test: genres.Passages, tokenizer: Tokenizer, seq_len: int) -> dict:
    """The NumPy bag-of-words regression trained on the same training passages (their text), and the
    majority-class rate, both scored on the same test passages."""
    train_ids, train_labels, _ = train.windows(seq_len)
    test_ids, test_labels, test_works = test.windows(seq_len)
    texts = lambda ids: [tokenizer.decode(row) for row in ids]  # noqa: E731
    bow = BowClassifier.fit(texts(train_ids), train_labels, len(train.label_names))
    report = accuracy_report(bow.predict_proba(texts(test_ids)), test_labels, test_works, test.label_names)
    return {"bow_accuracy": report["accuracy"], "bow_work_accuracy": report["work_accuracy"],
            "majority_accuracy": majority_rate(train_labels, test_labels)}


def report(trainer) -> dict:
    """The train summary's held-out figures: test and validation accuracy, the baselines."""
    scores = score_model(trainer.model, trainer.data.tokenizer, trainer.cfg.train.seq_len, trainer.device)
    return {"val_accuracy": round(scores["val"]["accuracy"], 4), "test_accuracy": round(scores["test"]["accuracy"], 4),
            "test_work_accuracy": round(scores["test"]["work_accuracy"], 4),
            "bow_test_accuracy": round(scores["baseline"]["bow_accuracy"], 4),
            "majority_test_accuracy": round(scores["baseline"]["majority_accuracy"], 4)}


def classify_text(run, text: str) -> dict[str, float]:
    """{label: probability} for `text`: a text longer than the training passages is cut into windows of
    train.seq_len tokens (the last one ending at the text's end) and their probabilities are averaged."""
    if not text.strip():
        raise QkvError("--text is empty")
    ids = np.asarray(run.tokenizer.encode(text), dtype=np.int64)
    T = min(run.config.train.seq_len, run.config.model.max_seq_len)
    starts = sorted({*range(0, max(1, len(ids) - T + 1), T), max(0, len(ids) - T)})
    windows = np.stack([ids[s:s + T] for s in starts])  # (N, min(T, len))
    probs = probabilities(run.model, windows, next(run.model.parameters()).device).mean(axis=0)
    return dict(zip(label_names(run), map(float, probs)))


def label_names(run) -> tuple[str, ...]:
    names = run.config.model.labels
    return names if names else tuple(f"class {i}" for i in range(run.config.model.n_classes))
