"""Held-out scoring against brute force: random-window validation loss, sliding-window bits per character."""
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from qkv.data.dataset import Batches
from qkv.models import build_model
from qkv.evaluate.tokens import score_tokens, val_loss

SEQ = 12


@pytest.fixture
def model(tiny_cfg):
    return build_model(tiny_cfg).train()


@pytest.fixture
def stream():
    return np.random.default_rng(3).integers(0, 32, 60).astype(np.uint16)


def brute_force_nats(model, tokens: np.ndarray, context: int) -> list[float]:
    """-log p(token i | up to `context` previous tokens), one forward per scored token."""
    ids = torch.as_tensor(tokens.astype(np.int64))
    out = []
    with torch.no_grad():
        for i in range(1, len(ids)):
            window = ids[max(0, i - context):i]
            logits = model.eval()(window[None])[0, -1].double()
            out.append(-logits.log_softmax(-1)[ids[i]].item())
    return out


def test_val_loss_is_the_mean_over_fixed_random_windows(model, stream):
    got = val_loss(model, stream, seq_len=SEQ, batch_size=3, batches=4, seed=9, device="cpu")
    sampler, losses = Batches(stream, SEQ, 3, 9), []
    model.eval()
    with torch.no_grad():
        for _ in range(4):
            x, y = (torch.from_numpy(a) for a in sampler.next())
            losses.append(F.cross_entropy(model(x).flatten(0, 1), y.flatten()).item())
    assert got == pytest.approx(float(np.mean(losses)), rel=1e-6)
    model.train()
    assert val_loss(model, stream, seq_len=SEQ, batch_size=3, batches=4, seed=9, device="cpu") == got
    assert model.training  # the caller's mode is restored


def test_stride_one_scores_every_token_with_full_context(model, stream):
    result = score_tokens(model, stream, characters=100, seq_len=SEQ, stride=1, device="cpu", batch_size=5)
    nats = brute_force_nats(model, stream, SEQ)
    assert result["tokens"] == len(stream) - 1
    assert result["loss"] == pytest.approx(sum(nats) / len(nats), rel=1e-5)
    assert result["perplexity"] == pytest.approx(math.exp(result["loss"]), rel=1e-12)
    assert result["bits_per_char"] == pytest.approx(sum(nats) / (math.log(2) * 100), rel=1e-5)


@pytest.mark.parametrize("stride", [4, 6, SEQ])
def test_every_token_scored_once_for_any_stride(model, stream, stride):
    """Every token after the first is scored exactly once, loss and bits/char describe the same total,
    and with stride == context (disjoint windows, the last moved back to full length) it equals brute force."""
    result = score_tokens(model, stream, characters=77, seq_len=SEQ, stride=stride, device="cpu")
    assert result["tokens"] == len(stream) - 1
    assert result["bits_per_char"] * math.log(2) * 77 == pytest.approx(result["loss"] * result["tokens"], rel=1e-9)
    if stride == SEQ:  # disjoint windows except the last, which is moved back to full length
        ids = torch.as_tensor(stream.astype(np.int64))
        total, scored = 0.0, 0
        with torch.no_grad():
            for begin in range(0, len(ids) - 1, SEQ):
                end = min(begin + SEQ + 1, len(ids))
                start = max(0, end - SEQ - 1)
                logits = model.eval()(ids[start:end - 1][None])[0]
                nll = F.cross_entropy(logits, ids[start + 1:end], reduction="none")
                total += nll[(begin + 1) - (start + 1):].sum().item()
                scored += end - (begin + 1)
        assert scored == len(stream) - 1
        assert result["loss"] == pytest.approx(total / scored, rel=1e-5)


def test_one_window_equals_plain_cross_entropy(model):
    tokens = np.random.default_rng(0).integers(0, 32, SEQ + 1).astype(np.uint16)
    result = score_tokens(model, tokens, characters=40, seq_len=SEQ, stride=SEQ // 2, device="cpu")
    ids = torch.as_tensor(tokens.astype(np.int64))
    with torch.no_grad():
        expected = F.cross_entropy(model.eval()(ids[None, :-1])[0], ids[1:]).item()
    assert result["tokens"] == SEQ and result["loss"] == pytest.approx(expected, rel=1e-6)
