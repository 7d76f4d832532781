"""The chunked head + cross-entropy against F.linear + F.cross_entropy under torch autograd."""
import pytest
import torch
import torch.nn.functional as F

import qkv
from qkv.nn import linear_cross_entropy as lce
from qkv.nn.linear_cross_entropy import cross_entropy, head_cross_entropy, linear_cross_entropy
from qkv.train.objectives import lm_loss, mlm_loss, seq2seq_loss


def reference(hidden, weight, bias, targets, eps):
    logits = F.linear(hidden, weight, bias)
    return F.cross_entropy(logits.flatten(0, -2), targets.flatten(), ignore_index=-100, label_smoothing=eps)


def grads(loss_fn, *tensors):
    leaves = [t.detach().clone().requires_grad_(t.requires_grad) for t in tensors]
    loss = loss_fn(*leaves)
    (2.5 * loss).backward()  # an incoming gradient other than 1
    return loss.detach(), [None if t.grad is None else t.grad for t in leaves]


@pytest.mark.parametrize("eps", [0.0, 0.1])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows_per_chunk", [1, 7, 64])  # many chunks, a ragged last one, one chunk
def test_equals_linear_then_cross_entropy(monkeypatch, eps, bias, rows_per_chunk):
    monkeypatch.setattr(lce, "chunk_rows", lambda vocab: rows_per_chunk)
    torch.manual_seed(0)
    V, D = 37, 16
    hidden = torch.randn(3, 11, D, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(V, D, dtype=torch.float64, requires_grad=True)
    b = torch.randn(V, dtype=torch.float64, requires_grad=True) if bias else None
    targets = torch.randint(0, V, (3, 11))
    targets[0, :4] = -100  # padding
    targets[2, -1] = -100
    args = (hidden, weight) + ((b,) if bias else ())
    ours, our_grads = grads(lambda h, w, *bb: linear_cross_entropy(h, w, bb[0] if bb else None, targets, eps), *args)
    theirs, their_grads = grads(lambda h, w, *bb: reference(h, w, bb[0] if bb else None, targets, eps), *args)
    torch.testing.assert_close(ours, theirs, rtol=1e-12, atol=1e-12)
    for mine, want in zip(our_grads, their_grads):
        torch.testing.assert_close(mine, want, rtol=1e-10, atol=1e-12)


def test_fp32_default_chunks_and_no_grad_path():
    torch.manual_seed(1)
    V, D = 3000, 24  # 1398 rows per chunk: 4000 rows take 3 chunks
    hidden, weight = torch.randn(4000, D), torch.randn(V, D) * 0.1
    targets = torch.randint(0, V, (4000,))
    assert lce.chunk_rows(V) < 4000
    with torch.no_grad():
        torch.testing.assert_close(linear_cross_entropy(hidden, weight, None, targets),
                                   reference(hidden, weight, None, targets, 0.0), rtol=1e-5, atol=1e-5)
    w = weight.clone().requires_grad_()
    ours = linear_cross_entropy(hidden, w, None, targets)
    ours.backward()
    w_ref = weight.clone().requires_grad_()
    reference(hidden, w_ref, None, targets, 0.0).backward()
    torch.testing.assert_close(w.grad, w_ref.grad, rtol=1e-4, atol=1e-6)


def test_no_grad_forms_no_gradients(monkeypatch):
    """Evaluation under no_grad with trainable weights: the loss only, no dloss/dH or dloss/dW products."""
    calls, mm = [], torch.mm
    monkeypatch.setattr(torch, "mm", lambda *a, **k: calls.append(1) or mm(*a, **k))
    hidden, weight = torch.randn(6, 4, requires_grad=True), torch.randn(10, 4, requires_grad=True)
    targets = torch.randint(0, 10, (6,))
    with torch.no_grad():
        loss = linear_cross_entropy(hidden, weight, None, targets)
    monkeypatch.undo()
    assert calls == [1]  # the logits' product alone
    torch.testing.assert_close(loss, reference(hidden, weight, None, targets, 0.0).detach(), rtol=1e-6, atol=1e-6)


def test_every_target_ignored_gives_nan_as_cross_entropy():
    hidden, weight = torch.randn(4, 8), torch.randn(5, 8)
    targets = torch.full((4,), -100)
    assert torch.isnan(linear_cross_entropy(hidden, weight, None, targets))
    assert torch.isnan(reference(hidden, weight, None, targets, 0.0))


def assert_same_loss_and_gradients(model, fused_loss, plain_logits, targets, eps=0.0):
    """The objective's loss (the model's hidden states, then the head and the loss in chunks on the rows
    with a target) against F.cross_entropy of model(...)'s logits: the loss and every gradient."""
    fused = fused_loss()
    fused.backward()
    fused_grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()
    plain = F.cross_entropy(plain_logits().flatten(0, 1), targets.flatten(), ignore_index=-100, label_smoothing=eps)
    plain.backward()
    torch.testing.assert_close(fused, plain, rtol=1e-6, atol=1e-6)
    for name, p in model.named_parameters():
        torch.testing.assert_close(fused_grads[name], p.grad, rtol=1e-5, atol=1e-6, msg=name)


def test_decoder_loss_with_targets_equals_its_logits_loss_and_tied_gradients():
    torch.manual_seed(0)
    cfg = qkv.ModelConfig(vocab_size=50, d_model=32, n_heads=4, n_layers=2, d_ff=64, max_seq_len=16)
    model = qkv.build_model(cfg)
    assert model.lm_head.weight is model.tok_emb.weight  # tied: the head's gradient joins the embedding's
    ids, targets = torch.randint(0, 50, (2, 12)), torch.randint(0, 50, (2, 12))
    targets[1, :3] = -100
    assert_same_loss_and_gradients(model, lambda: lm_loss(model, (ids, targets), 0.1),
                                   lambda: model(ids), targets, 0.1)


def test_bf16_weights_take_the_logits_path_and_autocast_the_chunks(monkeypatch):
    calls = []
    monkeypatch.setattr(lce, "linear_cross_entropy", lambda *a, **k: calls.append(1))
    head = torch.nn.Linear(8, 5, bias=False)
    hidden, targets = torch.randn(2, 3, 8), torch.randint(0, 5, (2, 3))
    loss = head_cross_entropy(head.to(torch.bfloat16), hidden.to(torch.bfloat16), targets)  # bf16 weights
    assert calls == [] and loss.dtype == torch.float32
    head_cross_entropy(head.float(), hidden, targets)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        head_cross_entropy(head, hidden, targets)
    assert calls == [1, 1]


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows_per_chunk", [5, None])  # many chunks (W's gradient: 256 rows a chunk), the default
def test_under_autocast_equals_autocast_linear_then_fp32_cross_entropy(monkeypatch, bias, rows_per_chunk):
    """Under bf16 autocast the chunks take bf16 products as F.linear would: the loss equals autocast's head +
    fp32 cross-entropy to fp32 rounding (same bf16 logits), the gradients to bf16 rounding of the products
    (each dloss/dL row rounded to bf16 once in both: 2^-8 relative, at most a few units in the sums)."""
    if rows_per_chunk:
        monkeypatch.setattr(lce, "chunk_rows", lambda vocab: rows_per_chunk)
        monkeypatch.setattr(lce, "LOW_PRECISION_WEIGHT_GRAD_ROWS", 7)
    torch.manual_seed(2)
    V, D, N = 300, 32, 61
    hidden, weight = torch.randn(N, D), torch.randn(V, D) * 0.2
    b = torch.randn(V) if bias else None
    targets = torch.randint(0, V, (N,))
    targets[:6] = -100
    tensors = (hidden, weight) + ((b,) if bias else ())

    def autocast(fn):
        def run(h, w, *bb):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return fn(h, w, bb[0] if bb else None)
        return run

    ours, our_grads = grads(autocast(lambda h, w, bb: linear_cross_entropy(h, w, bb, targets, 0.1)),
                            *[t.requires_grad_() for t in tensors])
    theirs, their_grads = grads(autocast(lambda h, w, bb: F.cross_entropy(
        F.linear(h, w, bb).float(), targets, ignore_index=-100, label_smoothing=0.1)), *tensors)
    exact, exact_grads = grads(lambda h, w, *bb: reference(h, w, bb[0] if bb else None, targets, 0.1),
                               *[t.double() for t in tensors])
    assert ours.dtype == torch.float32 and all(g.dtype == torch.float32 for g in our_grads)
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-6)
    for mine, want, true in zip(our_grads, their_grads, exact_grads):
        scale = true.abs().max().item()
        torch.testing.assert_close(mine, want, rtol=0, atol=2 ** -6 * scale)
        # and as close to fp64's gradient as autocast's own is, give or take bf16's rounding
        assert (mine.double() - true).abs().max() <= (want.double() - true).abs().max() + 2 ** -7 * scale


@pytest.mark.parametrize("hooked", [False, True])
def test_mlm_loss_on_the_masked_rows_equals_the_full_logits_loss(hooked):
    torch.manual_seed(0)
    cfg = qkv.ModelConfig(arch="encoder", head="mlm", vocab_size=40, d_model=32, n_heads=4, n_layers=2, d_ff=64,
                          max_seq_len=16)
    model = qkv.build_model(cfg)
    seen = []
    if hooked:  # a hook on the head must see the whole logits
        model.head.register_forward_hook(lambda module, args, out: seen.append(tuple(out.shape)))
    ids = torch.randint(0, 40, (3, 12))
    targets = torch.full((3, 12), -100)
    targets[0, 2], targets[1, 5], targets[1, 9], targets[2, 0] = 4, 7, 39, 11  # BERT's sparse targets
    assert_same_loss_and_gradients(model, lambda: mlm_loss(model, (ids, targets), 0.1),
                                   lambda: model(ids), targets, 0.1)
    assert seen == ([(3, 12, 40)] * 2 if hooked else [])


@pytest.mark.parametrize("hooked", [False, True])
def test_seq2seq_loss_on_the_target_rows_equals_the_full_logits_loss(hooked):
    torch.manual_seed(0)
    cfg = qkv.ModelConfig(arch="encoder-decoder", vocab_size=30, d_model=32, n_heads=4, n_layers=2, d_ff=64,
                          max_seq_len=16)
    model = qkv.build_model(cfg)
    seen = []
    if hooked:  # a hook on the head must see every position's logits
        model.lm_head.register_forward_hook(lambda module, args, out: seen.append(tuple(out.shape)))
    src, tgt = torch.randint(0, 30, (2, 9)), torch.randint(0, 30, (2, 7))
    src_mask, tgt_mask = torch.ones(2, 9, dtype=torch.long), torch.ones(2, 7, dtype=torch.long)
    src_mask[1, 6:], tgt_mask[1, 4:] = 0, 0  # right padding, as qkv.data.seq2seq pads
    labels = torch.randint(0, 30, (2, 7)).masked_fill(tgt_mask == 0, -100)
    assert_same_loss_and_gradients(model, lambda: seq2seq_loss(model, (src, src_mask, tgt, tgt_mask, labels), 0.0),
                                   lambda: model(src, tgt, src_mask, tgt_mask), labels)
    assert seen == ([(2, 7, 30)] * 2 if hooked else [])


def test_cross_entropy_is_mean_negative_log_softmax_and_smoothing():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 5, 11, generator=g, dtype=torch.float64)
    targets = torch.randint(0, 11, (2, 5), generator=g)
    targets[1, 3] = -100  # padding is ignored
    logp = logits.log_softmax(-1)
    keep = targets != -100
    nll = -logp.gather(-1, targets.clamp(min=0)[..., None])[..., 0][keep]
    loss = cross_entropy(logits, targets)
    assert loss.dtype == torch.float64  # fp64 logits are not rounded to fp32 (claim 21 compares to 1e-14)
    assert loss.item() == pytest.approx(nll.mean().item(), rel=1e-13)
    eps = 0.1  # target (1 - eps) onehot + eps / V (note 000 §13.3; SPEC claim 14)
    smoothed = (1 - eps) * nll - eps * logp[keep].mean(-1)
    assert cross_entropy(logits, targets, eps).item() == pytest.approx(smoothed.mean().item(), rel=1e-13)
    low = cross_entropy(logits.bfloat16(), targets)  # low-precision logits: the loss in fp32
    assert low.dtype == torch.float32 and low.item() == pytest.approx(nll.mean().item(), rel=2e-2)


@pytest.mark.parametrize("eps", [0.0, 0.1])
@pytest.mark.parametrize("rows_per_chunk", [1, 7, 64])
def test_soft_capped_loss_and_gradients_equal_autograd_of_c_tanh(monkeypatch, eps, rows_per_chunk):
    """Logits c tanh(Z / c) with Z = H W^T + b large enough that the cap bends them (|Z| up to ~5c): the
    chunked pass's loss and dH, dW, db against autograd through torch.tanh and F.cross_entropy."""
    monkeypatch.setattr(lce, "chunk_rows", lambda vocab: rows_per_chunk)
    torch.manual_seed(1)
    V, D, cap = 29, 8, 2.0
    hidden = torch.randn(2, 9, D, dtype=torch.float64, requires_grad=True)
    weight = (2 * torch.randn(V, D, dtype=torch.float64)).requires_grad_()
    b = torch.randn(V, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, V, (2, 9))
    targets[1, :3] = -100

    def capped(h, w, bb):
        logits = cap * torch.tanh(F.linear(h, w, bb) / cap)
        return F.cross_entropy(logits.flatten(0, -2), targets.flatten(), ignore_index=-100, label_smoothing=eps)

    assert (F.linear(hidden, weight, b).abs() > 3 * cap).any()  # the cap is not the identity here
    ours, our_grads = grads(lambda h, w, bb: linear_cross_entropy(h, w, bb, targets, eps, cap), hidden, weight, b)
    theirs, their_grads = grads(capped, hidden, weight, b)
    torch.testing.assert_close(ours, theirs, rtol=1e-12, atol=1e-12)
    for a, e in zip(our_grads, their_grads):
        torch.testing.assert_close(a, e, rtol=1e-10, atol=1e-12)


def test_a_soft_cap_head_bounds_its_logits_and_takes_the_chunked_loss():
    cap = 1.5
    head = lce.SoftCapHead(6, 11, cap=cap).double()
    x = 10 * torch.randn(4, 6, dtype=torch.float64)
    logits = head(x)
    torch.testing.assert_close(logits, cap * torch.tanh(F.linear(x, head.weight) / cap))
    assert logits.abs().max() < cap and (logits.abs() > 0.9 * cap).any()
    small = 1e-4 * torch.randn(3, 6, dtype=torch.float64)
    torch.testing.assert_close(head(small), F.linear(small, head.weight), rtol=1e-6, atol=0)  # ~Z where |Z| << c
    targets = torch.randint(0, 11, (4,))
    torch.testing.assert_close(head_cross_entropy(head, x, targets), F.cross_entropy(logits, targets),
                               rtol=1e-12, atol=1e-12)
