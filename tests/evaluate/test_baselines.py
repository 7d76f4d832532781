"""The NumPy bag-of-words softmax regression (qkv.evaluate.baselines): sparse products equal dense ones, the
gradient equals finite differences and torch autograd, and gradient descent reaches the optimum (where
autograd's gradient of the strongly convex objective vanishes)."""
import numpy as np
import pytest
import torch

from qkv.evaluate.baselines import BagOfWords, BowClassifier, Sparse, fit_softmax, majority_rate, objective


def random_sparse(rng, n=40, f=25, density=0.2) -> Sparse:
    dense = rng.normal(size=(n, f)) * (rng.random((n, f)) < density)
    dense[3] = 0.0  # an empty row
    ptr = np.concatenate([[0], np.cumsum((dense != 0).sum(1))])
    rows, cols = np.nonzero(dense)
    return Sparse(dense[rows, cols], cols, ptr, f)


def test_sparse_products_equal_the_dense_ones():
    rng = np.random.default_rng(0)
    X = random_sparse(rng)
    D, W, G = X.dense(), rng.normal(size=(25, 3)), rng.normal(size=(40, 3))
    np.testing.assert_allclose(X @ W, D @ W, atol=1e-12)
    np.testing.assert_allclose(X.t_matmul(G), D.T @ G, atol=1e-12)


def test_tfidf_rows_have_unit_norm_and_idf_weights():
    texts = ["the cat sat", "the dog", "dog dog cat", "nothing known here"]
    bow = BagOfWords.fit(texts[:3])
    X = bow.transform(texts).dense()
    np.testing.assert_allclose(np.linalg.norm(X[:3], axis=1), 1.0)
    assert not X[3].any()
    # "dog dog cat": tf-idf (1 + ln 2) * ln(4/3) for dog, 1 * ln(4/3) for cat (each in 2 of 3 texts)
    dog, cat = bow.vocabulary["dog"], bow.vocabulary["cat"]
    assert X[2, dog] / X[2, cat] == pytest.approx(1 + np.log(2))


def test_gradient_equals_finite_differences_and_autograd():
    rng = np.random.default_rng(1)
    X, y, lam = random_sparse(rng), rng.integers(0, 3, size=40), 0.05
    W, b = rng.normal(size=(25, 3)), rng.normal(size=3)
    _, dW, db = objective(W, b, X, y, lam)
    eps = 1e-6
    for index in [(0, 0), (4, 2), (17, 1)]:
        Wp, Wm = W.copy(), W.copy()
        Wp[index] += eps
        Wm[index] -= eps
        fd = (objective(Wp, b, X, y, lam)[0] - objective(Wm, b, X, y, lam)[0]) / (2 * eps)
        assert dW[index] == pytest.approx(fd, abs=1e-8)
    Wt, bt = torch.tensor(W, requires_grad=True), torch.tensor(b, requires_grad=True)
    logits = torch.tensor(X.dense()) @ Wt + bt
    loss = torch.nn.functional.cross_entropy(logits, torch.tensor(y)) + 0.5 * lam * (Wt ** 2).sum()
    loss.backward()
    assert objective(W, b, X, y, lam)[0] == pytest.approx(loss.item(), abs=1e-12)
    np.testing.assert_allclose(dW, Wt.grad.numpy(), atol=1e-12)
    np.testing.assert_allclose(db, bt.grad.numpy(), atol=1e-12)


def test_gradient_descent_reaches_the_optimum():
    """J is strongly convex (lam > 0), so its one minimum is where the gradient vanishes: autograd's gradient
    at the returned weights is zero to 1e-8, and no step along it lowers J."""
    rng = np.random.default_rng(2)
    X, y, lam = random_sparse(rng), rng.integers(0, 3, size=40), 0.1
    W, b = fit_softmax(X, y, 3, lam=lam, steps=400)
    Wt, bt = torch.tensor(W, requires_grad=True), torch.tensor(b, requires_grad=True)
    loss = torch.nn.functional.cross_entropy(torch.tensor(X.dense()) @ Wt + bt, torch.tensor(y)) \
        + 0.5 * lam * (Wt ** 2).sum()
    loss.backward()
    assert torch.cat([Wt.grad.flatten(), bt.grad]).norm().item() < 1e-8
    J = objective(W, b, X, y, lam)[0]
    for direction in (rng.normal(size=W.shape) for _ in range(3)):
        assert objective(W + 1e-3 * direction, b, X, y, lam)[0] > J


def test_classifier_learns_word_cues_and_majority_rate():
    texts = ["sword blood death", "jest wedding love", "blood grave", "love jest", "death sword grave"]
    labels = np.array([1, 0, 1, 0, 1])
    bow = BowClassifier.fit(texts, labels, 2, lam=1e-3, steps=300)
    probs = bow.predict_proba(["grave blood", "wedding"])
    assert probs[0].argmax() == 1 and probs[1].argmax() == 0
    np.testing.assert_allclose(probs.sum(1), 1.0)
    assert majority_rate(labels, np.array([0, 1, 1, 1])) == 0.75  # training majority 1: 3 of 4 right
