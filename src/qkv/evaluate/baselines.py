"""A bag-of-words softmax regression in NumPy: the baseline a text classifier must beat.

Features: the words of each passage (lower-cased runs of letters and apostrophes), the `max_words` words in
the most training passages, as sparse tf-idf  x_w = (1 + log tf_w) * log((1 + n) / (1 + df_w)), each row scaled to unit
L2 norm. Model: p = softmax(X W + b). Objective (mean cross-entropy + L2 on W, note 000 §13.2):

    J(W, b) = -(1/n) sum_i log p_i[y_i] + (lam / 2) ||W||_F^2
    dJ/dW = X^T (P - Y) / n + lam W,   dJ/db = 1^T (P - Y) / n          (P - onehot: note 000 LLM §3.1)

minimised by Nesterov-accelerated gradient descent with step 1 / L, L = 1/2 + lam: the Hessian of the
cross-entropy in the logits is diag(p) - p p^T (eigenvalues at most 1/2) and unit rows give ||X||_2^2 <= n
(the bias column adds at most 1/2 more, so the step uses L = 1 + lam).
"""
from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass
from functools import cached_property

import numpy as np

WORD = re.compile(r"[a-z']+")


def words(text: str) -> list[str]:
    return WORD.findall(text.lower())


@dataclass
class Sparse:
    """Rows of a sparse (N, F) matrix in CSR form: row i holds values[ptr[i]:ptr[i+1]] at columns cols[...].
    A passage has about a hundred distinct words of thousands, so the products below cost O(nnz C)."""
    values: np.ndarray  # (nnz,)
    cols: np.ndarray  # (nnz,)
    ptr: np.ndarray  # (N + 1,)
    n_cols: int

    @property
    def shape(self) -> tuple[int, int]:
        return len(self.ptr) - 1, self.n_cols

    @cached_property
    def rows(self) -> np.ndarray:  # (nnz,) the row of each value
        return np.repeat(np.arange(len(self.ptr) - 1), np.diff(self.ptr))

    def __matmul__(self, W: np.ndarray) -> np.ndarray:  # X W: (N, F) @ (F, C) -> (N, C)
        out = np.zeros((len(self.ptr) - 1, W.shape[1]))
        nonempty = np.diff(self.ptr) > 0  # segments between the starts of non-empty rows are exactly those rows
        if nonempty.any():
            out[nonempty] = np.add.reduceat(self.values[:, None] * W[self.cols], self.ptr[:-1][nonempty], axis=0)
        return out

    def t_matmul(self, G: np.ndarray) -> np.ndarray:  # X^T G: (F, N) @ (N, C) -> (F, C)
        rows, weights = self.rows, self.values
        return np.stack([np.bincount(self.cols, weights=weights * G[rows, c], minlength=self.n_cols)
                         for c in range(G.shape[1])], axis=1)

    def dense(self) -> np.ndarray:
        out = np.zeros((len(self.ptr) - 1, self.n_cols))
        out[self.rows, self.cols] = self.values
        return out


@dataclass
class BagOfWords:
    vocabulary: dict[str, int]
    idf: np.ndarray  # (F,)

    @classmethod
    def fit(cls, texts: list[str], max_words: int = 5000) -> "BagOfWords":
        df = Counter(word for text in texts for word in set(words(text)))
        kept = sorted(df, key=lambda w: (-df[w], w))[:max_words]
        idf = np.log((1 + len(texts)) / (1 + np.array([df[w] for w in kept], dtype=np.float64)))
        return cls({w: i for i, w in enumerate(kept)}, idf)

    def transform(self, texts: list[str]) -> Sparse:
        """tf-idf rows of unit L2 norm (a row with no known word stays zero), sparse."""
        values, cols, ptr = [], [], [0]
        for text in texts:
            counts = Counter(self.vocabulary[w] for w in words(text) if w in self.vocabulary)
            row_cols = np.fromiter(counts, dtype=np.int64, count=len(counts))
            row = (1 + np.log(np.fromiter(counts.values(), dtype=np.float64, count=len(counts)))) * self.idf[row_cols]
            norm = np.linalg.norm(row)
            values.append(row / norm if norm > 0 else row)
            cols.append(row_cols)
            ptr.append(ptr[-1] + len(row_cols))
        join = lambda parts, dtype: np.concatenate(parts) if parts else np.zeros(0, dtype)  # noqa: E731
        return Sparse(join(values, np.float64), join(cols, np.int64), np.asarray(ptr), len(self.vocabulary))


def softmax(logits: np.ndarray) -> np.ndarray:
    shifted = logits - logits.max(axis=1, keepdims=True)  # exp never overflows
    e = np.exp(shifted)
    return e / e.sum(axis=1, keepdims=True)


def objective(W: np.ndarray, b: np.ndarray, X, y: np.ndarray, lam: float):
    """(J, dJ/dW, dJ/db) for X (N, F) (a Sparse or an array), y (N,), W (F, C), b (C,)."""
    n = len(y)
    P = softmax(X @ W + b)  # (N, C)
    loss = -np.log(P[np.arange(n), y] + 1e-300).mean() + 0.5 * lam * np.sum(W * W)
    P[np.arange(n), y] -= 1.0  # P - Y
    XtG = X.t_matmul(P) if isinstance(X, Sparse) else X.T @ P
    return loss, XtG / n + lam * W, P.sum(axis=0) / n


def fit_softmax(X, y: np.ndarray, n_classes: int, *, lam: float = 1e-4,
                steps: int = 500) -> tuple[np.ndarray, np.ndarray]:
    """Nesterov gradient descent on J from zero weights; returns (W (F, C), b (C,))."""
    W, b = np.zeros((X.shape[1], n_classes)), np.zeros(n_classes)
    W_prev, b_prev = W, b
    step = 1.0 / (1.0 + lam)
    for t in range(1, steps + 1):
        momentum = (t - 1) / (t + 2)
        W_look, b_look = W + momentum * (W - W_prev), b + momentum * (b - b_prev)
        _, dW, db = objective(W_look, b_look, X, y, lam)
        W_prev, b_prev = W, b
        W, b = W_look - step * dW, b_look - step * db
    return W, b


@dataclass
class BowClassifier:
    features: BagOfWords
    W: np.ndarray
    b: np.ndarray

    @classmethod
    def fit(cls, texts: list[str], labels: np.ndarray, n_classes: int, *, lam: float = 1e-4,
            steps: int = 500, max_words: int = 5000) -> "BowClassifier":
        features = BagOfWords.fit(texts, max_words)
        W, b = fit_softmax(features.transform(texts), np.asarray(labels), n_classes, lam=lam, steps=steps)
        return cls(features, W, b)

    def predict_proba(self, texts: list[str]) -> np.ndarray:
        return softmax(self.features.transform(texts) @ self.W + self.b)  # (N, C)


def majority_rate(train_labels: np.ndarray, test_labels: np.ndarray) -> float:
    """Accuracy of always answering the training set's most frequent class."""
    majority = np.bincount(train_labels).argmax()
    return float((np.asarray(test_labels) == majority).mean())
