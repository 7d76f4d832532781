"""A vocabulary head and its cross-entropy in one pass over row chunks: the (N, V) logits never exist whole.

    logits L = H W_out^T (+ b)                      (N, V)   H: final hidden states (N, D)
    loss     = mean over kept rows of  logsumexp(L_t) - L_{t, y_t}           (note 000 §13.2)
    dloss/dL = (P - onehot(y)) / n,  P = softmax(L)                          (note 000 LLM §3.1)
    dloss/dH = dloss/dL W_out,  dloss/dW_out = (dloss/dL)^T H                (note 000 LLM §3.2)

With label smoothing eps the target is (1 - eps) onehot(y) + eps / V (note 000 §13.3): the loss adds
eps (logsumexp(L_t) - mean_j L_tj) and subtracts (1 - eps) L_ty instead of L_ty, and dloss/dL is
P - (1 - eps) onehot(y) - eps / V. Rows whose target is -100 (padding) count for nothing.

`linear_cross_entropy` takes C rows at a time (C x V about 8 MiB of fp32, so the chunk's logits stay in
cache): their logits, logsumexp and loss, and, when gradients are wanted, P - target in place of the
logits, then that chunk's share of dloss/dH and dloss/dW_out (and db); the backward only scales the
stored gradients by the incoming one. A step thus passes over each chunk's logits while they are in
cache, where log_softmax + nll_loss pass over the whole (N, V) tensor in memory five times (forward,
zero-filled gradient, scatter, two in the backward), and holds 2 N V fewer floats. The chunk's logits
are formed transposed, L^T = W H^T (V, C): on these CPUs the product with W on the left is 10-20%
faster than H W^T at a few hundred rows (benchmarks/decode_kernels.py measures the same effect).
On a GPT-2 training step on 2 CPU cores: +2-3.5% tokens/s against head + F.cross_entropy (A/B in one
process; README "Performance"). The decoder LM uses it on every row; the MLM and seq2seq models on the rows
that have a target only (qkv.models.heads.EncoderMLM, qkv.models.encoder_decoder).
It matches F.linear + F.cross_entropy to float rounding (tests/nn/test_linear_cross_entropy.py).
Under bf16 autocast the products W h^T, P W and P^T h take bf16 operands (W cast once a step, each chunk's
rows as it comes), as F.linear would under autocast, while the softmax, the loss and the sums of the
chunks' gradients stay fp32: the same logits as autocast's head, without its (N, V) bf16 logits, their
fp32 copy, the fp32 log-probabilities and their gradient (on SmolLM2's 49,152-word vocabulary and 2,048
rows, 1.4 GB at once).

Logit soft-capping (`SoftCapHead`, model.logit_softcap = c > 0; Gemma 2, Team et al. 2024; modded-nanogpt):
the logits are L = c tanh(Z / c) of the head's Z = H W_out^T, bounded in (-c, c) and ~Z where |Z| << c, and
dloss/dZ = dloss/dL (1 - tanh^2(Z / c)); the chunked pass applies both to each chunk.
"""
from __future__ import annotations

from contextlib import contextmanager, nullcontext

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from qkv.nn.fastpath import has_hooks, is_dtensor

IGNORE = -100
CHUNK_ELEMENTS = 2 ** 21  # logits per chunk: 8 MiB of fp32
LOW_PRECISION_WEIGHT_GRAD_ROWS = 256  # under autocast with W trained: fewer (V, D) chunk products to add


def wide(x: Tensor) -> Tensor:
    return x.float() if x.dtype in (torch.float16, torch.bfloat16) else x


def chunk_rows(vocab: int) -> int:
    return max(1, CHUNK_ELEMENTS // vocab)


class SoftCapHead(nn.Linear):
    """The vocabulary projection with soft-capped logits c tanh((H W^T + b) / c) (model.logit_softcap = c)."""

    def __init__(self, in_features: int, out_features: int, *, cap: float, bias: bool = False):
        super().__init__(in_features, out_features, bias=bias)
        self.cap = float(cap)

    def forward(self, x: Tensor) -> Tensor:
        return soft_cap(super().forward(x), self.cap)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, cap={self.cap}"


def soft_cap(logits: Tensor, cap: float) -> Tensor:
    return cap * torch.tanh(logits / cap)


class LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, bias: Tensor | None, targets: Tensor,
                label_smoothing: float, grad_enabled: bool, cap: float = 0.0,
                compute: torch.dtype | None = None) -> Tensor:
        N, V = hidden.shape[0], weight.shape[0]
        keep = targets != IGNORE  # (N,)
        count = keep.sum()
        wants = ctx.needs_input_grad if grad_enabled else (False,) * 3  # (set under no_grad too)
        grad_hidden = hidden.new_empty(hidden.shape) if wants[0] else None
        grad_weight = torch.zeros_like(weight) if wants[1] else None
        grad_bias = torch.zeros_like(bias) if bias is not None and wants[2] else None
        total = hidden.new_zeros((), dtype=wide(hidden).dtype)
        eps = label_smoothing
        # autocast's products: W and each chunk's rows cast to `compute` (bf16), as F.linear under autocast
        # would; the softmax, the loss and the gradients' chunk sums stay fp32
        low = compute is not None and hidden.dtype == torch.float32  # autocast leaves fp64 alone
        w = weight.to(compute) if low else weight
        b = bias.to(compute) if low and bias is not None else bias
        rows_per_chunk = chunk_rows(V)
        if low and grad_weight is not None:  # each chunk's dloss/dW is a (V, D) low-precision product to add
            rows_per_chunk = max(rows_per_chunk, LOW_PRECISION_WEIGHT_GRAD_ROWS)
        with torch.autocast(hidden.device.type, enabled=False):
            for start in range(0, N, rows_per_chunk):
                rows = slice(start, start + rows_per_chunk)
                h, y, kept = hidden[rows], targets[rows].clamp(min=0)[None, :], keep[rows][None, :]  # y (1, C)
                h = h.to(compute) if low else h
                # the chunk's logits transposed, L^T = W h^T (V, C): W on the left reads it faster on CPU
                logits = wide(torch.mm(w, h.t()) if b is None else torch.addmm(b[:, None], w, h.t()))
                if cap:  # L = c tanh(Z / c); keep tanh for the backward's 1 - tanh^2
                    squashed = torch.tanh(logits.div_(cap))
                    logits = squashed * cap
                loss = -(1 - eps) * logits.gather(0, y)  # (1, C)
                if eps:
                    loss -= eps * logits.mean(dim=0, keepdim=True)
                top = logits.amax(dim=0, keepdim=True)
                exps = logits.sub_(top).exp_()  # exp(L - max), in place of the logits: one pass, one exp
                sums = exps.sum(dim=0, keepdim=True)
                loss += top + sums.log()  # + logsumexp
                total += loss.masked_fill(~kept, 0.0).sum()
                if not any(wants[:3]):
                    continue
                probs = exps.div_(sums)  # P^T
                probs.scatter_add_(0, y, probs.new_full(y.shape, -(1 - eps)))  # P^T - (1 - eps) onehot^T
                if eps:
                    probs.sub_(eps / V)
                if cap:
                    probs.mul_(1 - squashed.square_())  # dloss/dZ = dloss/dL (1 - tanh^2(Z / c))
                probs = probs.mul_(kept).to(w.dtype)  # padding rows: no gradient
                if grad_hidden is not None:
                    if low:
                        grad_hidden[rows] = torch.mm(probs.t(), w)  # (C, D), into hidden's precision
                    else:
                        torch.mm(probs.t(), w, out=grad_hidden[rows])
                if grad_weight is not None:
                    if low:
                        grad_weight += torch.mm(probs, h)  # (V, D), summed over chunks in fp32
                    else:
                        grad_weight.addmm_(probs, h)
                if grad_bias is not None:
                    grad_bias += probs.sum(1)
        ctx.save_for_backward(grad_hidden, grad_weight, grad_bias, count)
        return total / count  # at least fp32, as cross_entropy; no kept row: nan, as F.cross_entropy

    @staticmethod
    def backward(ctx, grad_loss: Tensor):
        grad_hidden, grad_weight, grad_bias, count = ctx.saved_tensors
        scale = grad_loss / count
        return tuple(None if g is None else g * scale.to(g.dtype) for g in (grad_hidden, grad_weight, grad_bias)) \
            + (None, None, None, None, None)


def linear_cross_entropy(hidden: Tensor, weight: Tensor, bias: Tensor | None, targets: Tensor,
                         label_smoothing: float = 0.0, cap: float = 0.0) -> Tensor:
    """Mean cross-entropy of (hidden (..., D) W^T + b), soft-capped at `cap` when > 0, against targets (...),
    -100 ignored; a scalar. Under autocast the products take autocast's dtype, the rest stays fp32."""
    device = hidden.device.type
    compute = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None
    return LinearCrossEntropy.apply(hidden.reshape(-1, hidden.shape[-1]), weight, bias, targets.reshape(-1),
                                    float(label_smoothing), torch.is_grad_enabled(), float(cap), compute)


def cross_entropy(logits: Tensor, targets: Tensor, label_smoothing: float = 0.0) -> Tensor:
    """Mean over tokens of -log softmax(logits)[target] (note 000 §13.2), in at least fp32 (fp64 logits stay
    fp64), from whole logits (..., V) and targets (...); targets of -100 (padding) are ignored. Label
    smoothing uses the target (1 - eps) onehot + eps / V (note 000 §13.3)."""
    return F.cross_entropy(wide(logits.flatten(0, -2)), targets.flatten(), ignore_index=IGNORE,
                           label_smoothing=label_smoothing)


def target_rows(hidden: Tensor, targets: Tensor) -> tuple[Tensor, Tensor]:
    """The rows of hidden (..., D) and targets (...) that have a target (not -100): (n, D), (n,). A head
    that acts on each position alone needs no logits for the others (MLM's unmasked tokens, padding)."""
    picked = targets != IGNORE
    return hidden[picked], targets[picked]


def head_cross_entropy(head: nn.Module, hidden: Tensor, targets: Tensor, label_smoothing: float = 0.0) -> Tensor:
    """The loss of `head`(hidden) against targets: chunked (`linear_cross_entropy`) for a plain nn.Linear
    with plain fp32/fp64 weights and no hooks, under bf16 autocast too (its products in bf16);
    vocabulary-parallel (`vocab_parallel_loss`) for tensor parallel's head, whose logits stay split over V;
    otherwise the head's logits, then F.cross_entropy in fp32 (bf16 weights, a hooked head, fp16 autocast:
    fp16's loss scaling must see the logits' gradient overflow in fp16 wherever the run is laid out, as the
    pipeline's last stage, which takes whole logits, does)."""
    weight = getattr(head, "weight", None)
    device = hidden.device.type
    fp16 = torch.is_autocast_enabled(device) and torch.get_autocast_dtype(device) == torch.float16
    if (type(head) in (nn.Linear, SoftCapHead) and not has_hooks(head) and not is_dtensor(weight)
            and not is_dtensor(hidden) and hidden.dtype == weight.dtype and not fp16
            and hidden.dtype in (torch.float32, torch.float64)):  # chunk sums of gradients in full precision
        return linear_cross_entropy(hidden, weight, head.bias, targets, label_smoothing, getattr(head, "cap", 0.0))
    logits = head(hidden)
    if not is_dtensor(logits):
        return cross_entropy(logits, targets, label_smoothing)
    if label_smoothing:  # torch's loss_parallel has no label smoothing: the whole (B, T, V) logits, gathered
        return cross_entropy(logits.full_tensor(), targets, label_smoothing)
    with vocab_parallel_loss():
        loss = F.cross_entropy(wide(logits.flatten(0, -2)), targets.flatten(), ignore_index=IGNORE)
    return loss.to_local()  # the same scalar on every rank


_vocab_parallel_depth = 0


@contextmanager
def vocab_parallel_loss():
    """torch's loss_parallel, re-entrant: cross-entropy of logits split over the vocabulary (a DTensor sharded
    on its last dim, tensor parallel's head) without gathering them. Each rank holds (N, V/t) logits; the
    logsumexp takes the max and the sum of exponentials over the ranks (two all-reduces of N values) and the
    target's logit from the rank whose slice holds it (Megatron-LM's vocabulary-parallel cross-entropy,
    Shoeybi et al. 2019 §3); dloss/dL = (P - onehot(y)) / n is local to each slice (note 000 LLM §3.1).
    The backward of such a loss must run inside it too (the training step enters it around both)."""
    global _vocab_parallel_depth
    from torch.distributed.tensor.parallel import loss_parallel

    with loss_parallel() if _vocab_parallel_depth == 0 else nullcontext():
        _vocab_parallel_depth += 1
        try:
            yield
        finally:
            _vocab_parallel_depth -= 1
