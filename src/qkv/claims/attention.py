"""Claims about attention and its cost: 1, 2, 6, 7, 15-20."""
from __future__ import annotations

import numpy as np
import torch

from qkv.analysis.measure import count_flops, saved_for_backward_bytes
from qkv.claims.base import Result, claim, status
from qkv.nn.kernels import KERNELS, kernel_for, naive
from qkv.config import ModelConfig
from qkv.models import build, build_model
from qkv.nn.attention import Attention, AttentionContext
from qkv.nn.ffn import MLP
from qkv.nn.positional import Positional
from qkv.ref import gradcheck
from qkv.ref.linear_attention import linear_explicit, linear_forward

F64 = torch.float64


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _attend(q, k, v, mask=None):
    """softmax(Q K^T / sqrt(d_k) + M) V with qkv's naive kernel (note 000 §2.1.4)."""
    return naive(q, k, v, mask=mask, causal=False, bias=None, scale=q.shape[-1] ** -0.5)


@claim(1, "Var(q.k) = d_k for unit-variance iid components; dividing by sqrt(d_k) restores variance 1",
       "000 §2.1.3")
def scaled_dot_product_variance() -> Result:
    measured, ok = {}, True
    for d_k in (16, 64, 256):
        q, k = torch.randn(2, 20_000, d_k, generator=_gen(d_k), dtype=F64)
        dots = (q * k).sum(-1)  # 20k samples of q . k
        var, scaled = dots.var().item(), (dots / d_k ** 0.5).var().item()
        measured[f"d_k={d_k}"] = {"var_qk": round(var, 2), "var_scaled": round(scaled, 4)}
        ok &= abs(var / d_k - 1) < 0.05 and abs(scaled - 1) < 0.05
    keys = torch.randn(2000, 32, 256, generator=_gen(1), dtype=F64)  # 32 keys per query, d_k = 256
    queries = torch.randn(2000, 256, generator=_gen(2), dtype=F64)
    raw = (keys * queries[:, None]).sum(-1)  # q . k_j (2000, 32)
    measured["mean max softmax weight, 32 keys, d_k=256"] = {
        "unscaled": round(raw.softmax(-1).max(-1).values.mean().item(), 3),
        "scaled": round((raw / 16).softmax(-1).max(-1).values.mean().item(), 3)}
    return Result(status(ok), measured, "20,000 samples per d_k (standard error ~1%); tolerance 5%. Unscaled scores saturate the "
                  "softmax (one weight near 1, gradients near 0), the motivation of the note.")


@claim(2, "multi-head attention costs the same FLOPs as one head of width d_model", "000 §2.2.4, §10.1.2")
def multi_head_cost() -> Result:
    n, d, h = 128, 64, 8
    x = torch.randn(3, 1, 1, n, d, generator=_gen(), dtype=F64)
    one, _ = count_flops(lambda: _attend(x[0], x[1], x[2]))  # (1, 1, n, d)
    heads = x.reshape(3, 1, n, h, d // h).transpose(2, 3)  # (3, 1, h, n, d/h)
    many, _ = count_flops(lambda: _attend(heads[0], heads[1], heads[2]))
    d_k = d // h
    note = 2 * h * ((n / h) ** 2 * d_k + (n / h) * d_k * d_k)  # the note's h (n/h)^2 form, in FLOPs
    ok = one == many == 2 * 2 * n * n * d
    return Result(status(ok, "corrected"),
                  {"flops_1_head_width_d": one, "flops_8_heads_width_d/8": many, "formula_4n^2d": 4 * n * n * d,
                   "note_h(n/h)^2_form_flops": int(note)},
                  "Counted with torch.utils.flop_counter (Q K^T and A V, n=128, d=64). The totals agree, but the "
                  "note's per-head cost (n/h)^2 d_k is wrong: every head attends over all n positions, so a head "
                  "costs n^2 d_k and h heads n^2 d (000 §10.1.2 has it right); the (n/h)^2 form undercounts h-fold.")


@claim(6, "self-attention without positional encoding is permutation-equivariant", "000 §20")
def permutation_equivariance() -> Result:
    torch.manual_seed(0)
    cfg = ModelConfig(d_model=32, n_heads=4, d_ff=64, positional="none", attention="naive")
    block = build.block(cfg).double().eval()
    x = torch.randn(2, 9, 32, generator=_gen(), dtype=F64)
    perm = torch.randperm(9, generator=_gen(1))
    pos = torch.arange(9).expand(2, 9)

    def layer(inp, causal):
        return block(inp, AttentionContext(Positional(), pos, pos, None, causal=causal))

    free = (layer(x[:, perm], False) - layer(x, False)[:, perm]).abs().max().item()
    masked = (layer(x[:, perm], True) - layer(x, True)[:, perm]).abs().max().item()
    return Result(status(free < 1e-12 and masked > 1e-3),
                  {"max|f(Px) - P f(x)| (no mask)": free, "same with a causal mask": masked},
                  "A whole Pre-LN block (attention + FFN) in float64, 9 tokens. The causal mask breaks the "
                  "symmetry (position enters through M), as positional encodings do.")


@claim(7, "the position-wise FFN applied row by row equals the matrix form", "000 §9.1, §4.2")
def ffn_rows() -> Result:
    torch.manual_seed(0)
    ffn = MLP(16, 64, activation="relu", bias=True).double()
    x = torch.randn(11, 16, generator=_gen(), dtype=F64)
    rows = torch.stack([ffn(x[i:i + 1])[0] for i in range(11)])
    diff = (rows - ffn(x)).abs().max().item()
    return Result(status(diff < 1e-12), {"max|row by row - matrix|": diff}, "ReLU FFN, 11 rows, float64.")


@claim(15, "attention is not invariant to the projections W_Q, W_K, W_V", "000 §16.1")
def projection_invariance() -> Result:
    n, d = 12, 8
    X = torch.randn(n, d, generator=_gen(), dtype=F64)
    W_q, W_k, W_v = torch.randn(3, d, d, generator=_gen(1), dtype=F64)

    def best_residual(W_q, W_k, W_v):
        """min over W' of ||Attn(X W_q, X W_k, X W_v) - Attn(X, X, X) W'|| / ||lhs||, by least squares."""
        lhs = _attend(X @ W_q, X @ W_k, X @ W_v)
        base = _attend(X, X, X)
        W = torch.linalg.lstsq(base, lhs).solution
        return ((base @ W - lhs).norm() / lhs.norm()).item()

    general = best_residual(W_q, W_k, W_v)
    inverse = best_residual(W_q, torch.linalg.inv(W_q).T, W_v)  # W_Q W_K^T = I: scores unchanged
    return Result(status(general > 0.05 and inverse < 1e-10, "corrected"),
                  {"relative residual, random W": general, "relative residual, W_Q W_K^T = I": inverse},
                  "The best linear W' fitted by least squares cannot absorb random projections: the scores "
                  "Q W_Q W_K^T K^T change the softmax. Only when W_Q W_K^T = I does Attn(XW_Q, XW_K, XW_V) = "
                  "Attn(X, X, X) W_V. The note's displayed 'theorem' (equality for some W_O') is false in general; "
                  "its conclusion, which this claim states, holds.")


@claim(16, "local-window attention equals full attention with the band mask |i-j| <= w; cost O(n w)", "000 §15.1.1")
def local_window() -> Result:
    w, d, measured = 4, 16, {}
    local = kernel_for("local", window=w)  # the kernel model.attention="local" trains with

    def run(q, k, v):
        return local(q, k, v, mask=None, causal=False, bias=None, scale=d ** -0.5)

    q, k, v = torch.randn(3, 1, 2, 64, d, generator=_gen(), dtype=F64)
    i = torch.arange(64)
    band = ((i[:, None] - i[None, :]).abs() <= w)[None, None]  # (1, 1, n, n)
    measured["max|local - masked full|"] = (run(q, k, v) - _attend(q, k, v, mask=band)).abs().max().item()
    costs = {}
    for n in (256, 512):
        q, k, v = torch.randn(3, 1, 1, n, d, generator=_gen(n), dtype=F64)
        costs[n] = (count_flops(lambda: run(q, k, v))[0], count_flops(lambda: _attend(q, k, v))[0])
    measured["local flops n=256, 512"] = [costs[256][0], costs[512][0]]
    measured["full flops n=256, 512"] = [costs[256][1], costs[512][1]]
    growth = costs[512][0] / costs[256][0], costs[512][1] / costs[256][1]
    measured["growth when n doubles (local, full)"] = growth
    ok = measured["max|local - masked full|"] < 1e-12 and abs(growth[0] - 2) < 1e-9 and abs(growth[1] - 4) < 1e-9
    return Result(status(ok), measured, f"qkv.nn.sparse.local (model.attention='local'), w={w}, float64: blocks of "
                  f"w queries against their 3w-key band, 2 x 2 n (3w) d FLOPs, linear in n.")


@claim(17, "linear attention with feature map phi equals its explicit O(n^2) form and costs O(n d^2)", "000 §15.2")
def linear_attention() -> Result:
    rng = np.random.default_rng(0)
    q, k, v = (rng.normal(size=(1, 2, 40, 8)) for _ in range(3))
    measured = {}
    for causal in (False, True):
        fast, _ = linear_forward(q, k, v, mask=None, causal=causal, bias=None, scale=None)
        measured[f"max|O(n d^2) - explicit| causal={causal}"] = float(np.abs(fast - linear_explicit(q, k, v, causal)).max())

    spec = KERNELS.get("linear")  # the kernel model.attention="linear" trains with, and its explicit form
    costs = {}
    for n in (256, 512):
        q, k, v = (torch.randn(1, 1, n, 32, generator=_gen(n + i), dtype=F64) for i in range(3))
        costs[n] = (count_flops(lambda: spec.fn(q, k, v, mask=None, causal=False, bias=None, scale=1.0))[0],
                    count_flops(lambda: spec.weights(q, k, mask=None, causal=False, bias=None, scale=1.0) @ v)[0])
    growth = costs[512][0] / costs[256][0], costs[512][1] / costs[256][1]
    measured["torch kernel flops n=512: phi(Q)(phi(K)^T V) vs explicit (phi(Q)phi(K)^T) V"] = list(costs[512])
    measured["growth when n doubles (linear, explicit)"] = growth
    ok = (max(v for key, v in measured.items() if key.startswith("max")) < 1e-10
          and abs(growth[0] - 2) < 0.01 and abs(growth[1] - 4) < 0.01)
    return Result(status(ok), measured, "qkv.ref.linear_attention against its explicit form, phi = elu + 1 (the "
                  "note leaves phi open); costs counted on the torch kernel qkv.nn.linear_attention (model.attention="
                  "'linear'): the sums phi(K)^T V grow linearly in n, the explicit form quadratically.")


@claim(18, "flash (tiled online-softmax) attention equals standard attention; its extra memory is O(n)", "002 (Flash Attention)")
def flash() -> Result:
    match = gradcheck.flash_matches_naive()
    sizes = (128, 256, 512)
    naive_bytes = [gradcheck.attention_peak_bytes("naive", n) for n in sizes]
    flash_bytes = [gradcheck.attention_peak_bytes("flash", n) for n in sizes]
    growth = (naive_bytes[2] / naive_bytes[1], flash_bytes[2] / flash_bytes[1])
    saved = {name: [torch_saved_bytes(name, n) for n in (256, 512, 1024)] for name in ("naive", "flash")}
    torch_growth = (saved["naive"][2] / saved["naive"][1], saved["flash"][2] / saved["flash"][1])
    ok = (max(match.values()) < 1e-10 and growth[0] > 3.2 and growth[1] < 2.5
          and torch_growth[0] > 3.5 and torch_growth[1] <= 2.0 + 1e-9)
    return Result(status(ok), {"max|flash - naive| (forward, backward)": match,
                               "peak bytes naive n=128,256,512": naive_bytes, "peak bytes flash n=128,256,512": flash_bytes,
                               "growth 256->512 (naive, flash)": [round(g, 2) for g in growth],
                               "torch: bytes saved for the backward n=256,512,1024 (naive, flash)":
                                   [saved["naive"], saved["flash"]],
                               "torch: growth 512->1024 (naive, flash)": [round(g, 2) for g in torch_growth]},
                  "qkv.ref.flash vs qkv.ref.kernels (NumPy float64, causal, block 64); memory is tracemalloc's peak "
                  "inside forward + backward: the naive kernel stores the n x n scores (x4 per doubling), "
                  "flash only O(n) statistics and one tile (x2). The torch engine's kernels (qkv.nn.kernels naive, "
                  "qkv.nn.flash), counted by what autograd saves for the backward (B=1, H=2, Dh=16, fp32): "
                  "naive keeps its n x n probabilities, flash q, k, v, the output and the log-sum-exp.")


def torch_saved_bytes(kernel: str, n: int) -> int:
    q, k, v = (torch.randn(1, 2, n, 16, requires_grad=True) for _ in range(3))
    fn = KERNELS.get(kernel).fn
    return saved_for_backward_bytes(lambda: fn(q, k, v, mask=None, causal=True, bias=None, scale=0.25))


@claim(19, "attention costs 2n^2 d + 4 n d^2 and the FFN 8 n d^2 per layer", "000 §9.3, §10.1.4")
def layer_costs() -> Result:
    n, d = 64, 128
    attn = Attention(d, 4, 4, kernel="naive", bias=False).double()
    ffn = MLP(d, 4 * d, activation="relu", bias=False).double()
    x = torch.randn(1, n, d, generator=_gen(), dtype=F64)
    pos = torch.arange(n)[None]
    ctx = AttentionContext(Positional(), pos, pos, None, causal=False)
    attn_flops, _ = count_flops(lambda: attn(x, ctx))
    ffn_flops, _ = count_flops(lambda: ffn(x))
    macs_attn, macs_ffn = 2 * n * n * d + 4 * n * d * d, 8 * n * d * d
    ok = attn_flops == 2 * macs_attn and ffn_flops == 2 * macs_ffn
    return Result(status(ok), {"attention counted FLOPs": attn_flops, "note 2n^2d + 4nd^2 (multiply-adds)": macs_attn,
                               "FFN counted FLOPs": ffn_flops, "note 8nd^2 (multiply-adds)": macs_ffn},
                  "Units: the note counts multiply-adds; torch.utils.flop_counter counts 2 FLOPs per multiply-add, "
                  "so counted = 2 x the note's expression exactly (n=64, d=128, d_ff=4d, naive kernel).")


@claim(20, "the backward pass costs about 2x the forward", "000 LLM §5.3")
def backward_cost() -> Result:
    torch.manual_seed(0)
    model = build_model(ModelConfig(vocab_size=300, d_model=64, n_heads=4, n_layers=2, d_ff=256, max_seq_len=64,
                                    attention="naive"))
    ids = torch.randint(0, 300, (2, 64), generator=_gen())
    fwd, _ = count_flops(lambda: model(ids))
    both, _ = count_flops(lambda: model(ids).float().logsumexp(-1).mean().backward())
    ratio = (both - fwd) / fwd
    return Result(status(abs(ratio - 2) < 0.05), {"forward FLOPs": fwd, "backward FLOPs": both - fwd,
                                                  "backward / forward": ratio},
                  "torch.utils.flop_counter on a built decoder: each matmul y = xW needs dx = dy W^T and "
                  "dW = x^T dy, two matmuls of the forward's size; the note's '2-3x' range includes "
                  "recomputation and memory-bound ops that FLOPs do not count.")
