"""qkv.nn.flash: the hand-written backward against torch's gradcheck (finite differences, float64) for every
input the kernel takes (mask, causal, a learnt score bias broadcast over the batch, Shaw's value table, a
sparse pattern, cached keys, dropout with replayed masks), and the memory it saves for the backward: O(n)."""
import functools

import pytest
import torch

from qkv.analysis.measure import saved_for_backward_bytes
from qkv.nn import flash as flash_module
from qkv.nn.flash import FlashAttention, tiled
from qkv.nn.kernels import KERNELS, naive
from qkv.nn.sparse import dilated_pattern

B, H, Dh = 2, 2, 4


def inputs(T, S, dtype=torch.float64):
    q, k, v = (torch.randn(B, H, n, Dh, dtype=dtype, requires_grad=True) for n in (T, S, S))
    return q, k, v


def padding(T, S):
    keys = torch.ones(B, S, dtype=torch.bool)
    keys[1, :2] = False
    own = torch.arange(S)[None, :] == torch.arange(S - T, S)[:, None]
    causal = torch.arange(S)[None, :] <= torch.arange(S - T, S)[:, None]
    return (keys[:, None, None, :] & causal) | own  # (B, 1, T, S)


CASES = {
    "causal": dict(causal=True),
    "padded": dict(mask=True),
    "bias": dict(bias=True),
    "value": dict(value=True, causal=True),
    "pattern": dict(pattern=True, causal=True),
    "cached": dict(causal=True, T=3),
    "dropout": dict(causal=True, dropout=0.3),
    "all": dict(mask=True, bias=True, value=True, dropout=0.2),
}


@pytest.mark.parametrize("case", CASES)
def test_backward_passes_gradcheck(case):
    spec = dict(CASES[case])
    torch.manual_seed(0)
    T, S = spec.get("T", 7), 7
    q, k, v = inputs(T, S)
    bias = torch.randn(1, H, T, S, dtype=torch.float64, requires_grad=True) if spec.get("bias") else None
    table = torch.randn(5, Dh, dtype=torch.float64, requires_grad=True) if spec.get("value") else None
    index = torch.randint(0, 5, (B, T, S)) if spec.get("value") else None
    mask = padding(T, S) if spec.get("mask") else None
    pattern = functools.partial(dilated_pattern, window=2) if spec.get("pattern") else None

    def f(q, k, v, bias, table):  # block 3: several tiles, a partial last one; a fixed dropout seed
        return FlashAttention.apply(q, k, v, bias, table, index, mask, spec.get("causal", False), 0.5, pattern, 3,
                                    spec.get("dropout", 0.0), 1234)

    assert torch.autograd.gradcheck(f, (q, k, v, bias, table), eps=1e-6, atol=1e-7, rtol=1e-5)


def test_without_dropout_it_is_the_naive_kernel_values_and_gradients(monkeypatch):
    monkeypatch.setattr(flash_module, "BLOCK", 3)
    torch.manual_seed(1)
    q, k, v = inputs(6, 6)
    bias = torch.randn(B, H, 6, 6, dtype=torch.float64, requires_grad=True)
    upstream = torch.randn(B, H, 6, Dh, dtype=torch.float64)
    outs = [kernel(q, k, v, mask=padding(6, 6), causal=False, bias=bias, scale=0.5) for kernel in (tiled, naive)]
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-12, atol=1e-12)
    grads = [torch.autograd.grad(out, (q, k, v, bias), upstream) for out in outs]
    for got, want in zip(*grads):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def saved_bytes(kernel, n: int) -> int:
    """Bytes that autograd keeps for the backward of one attention call at sequence length n."""
    q, k, v = (torch.randn(1, H, n, 16, requires_grad=True) for _ in range(3))
    return saved_for_backward_bytes(lambda: kernel(q, k, v, mask=None, causal=True, bias=None, scale=0.25))


def test_flash_saves_linear_memory_and_naive_quadratic():
    """Doubling n doubles what flash keeps (q, k, v, out, L); the naive kernel's probabilities quadruple."""
    flash = [saved_bytes(KERNELS.get("flash").fn, n) for n in (256, 512, 1024)]
    dense = [saved_bytes(naive, n) for n in (256, 512, 1024)]
    assert all(b / a <= 2.0 + 1e-9 for a, b in zip(flash, flash[1:])), flash
    assert all(b / a >= 3.5 for a, b in zip(dense, dense[1:])), dense
    assert flash[-1] == 1 * H * 1024 * (4 * 16 + 1) * 4  # q, k, v, out (fp32) and L: nothing else


def test_dropout_masks_follow_the_global_seed_and_average_out():
    q, k, v = (torch.randn(1, 1, 4, 4).expand(4000, 1, 4, 4) for _ in range(3))
    torch.manual_seed(5)
    first = tiled(q, k, v, mask=None, causal=True, bias=None, scale=0.5, dropout=0.5)
    torch.manual_seed(5)
    again = tiled(q, k, v, mask=None, causal=True, bias=None, scale=0.5, dropout=0.5)
    assert torch.equal(first, again)
    exact = tiled(q[:1], k[:1], v[:1], mask=None, causal=True, bias=None, scale=0.5)
    torch.testing.assert_close(first.mean(0, keepdim=True), exact, atol=0.08, rtol=0)  # E[dropout(A)] = A


def test_tiles_are_computed_in_the_wide_dtype_under_autocast():
    """Under bf16 autocast the tiles' products still run in fp32, forward and backward alike, so the log-sum-exp
    saved by the forward matches the backward's recomputed scores: the same values and gradients as in fp32."""
    torch.manual_seed(2)
    q, k, v = (torch.randn(1, 2, 9, 8, requires_grad=True) for _ in range(3))
    upstream = torch.randn(1, 2, 9, 8)

    def run():
        out = tiled(q, k, v, mask=None, causal=True, bias=None, scale=0.35, block=4)
        return out, torch.autograd.grad(out, (q, k, v), upstream)

    plain, plain_grads = run()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        mixed, mixed_grads = run()
    torch.testing.assert_close(mixed, plain, rtol=0, atol=0)
    for got, want in zip(mixed_grads, plain_grads):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_fused_dispatch_rules(monkeypatch):
    """On CUDA, `flash` hands a call to torch's fused kernels only when they compute exactly what the tiled
    kernel does: no bias, value term or padding mask, causal only with T = S (torch aligns it top-left) or
    one query; "flash" for fp16 / bf16 on compute capability 8.0+, else "efficient". On CPU: always tiled.
    (The rules, with a stand-in CUDA tensor; the fused kernels themselves run only in benchmarks/gpu.py.)"""
    from types import SimpleNamespace

    from qkv.nn import flash as module

    def fake(T, S=None, dtype=torch.bfloat16, Dh=64):
        cuda = torch.device("cuda")
        return (SimpleNamespace(device=cuda, dtype=dtype, shape=(2, 4, T, Dh)),
                SimpleNamespace(device=cuda, dtype=dtype, shape=(2, 4, S or T, Dh)))

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    pick = lambda q, k, **kw: module.fused_backend(q, k, **{**dict(mask=None, causal=True, bias=None,  # noqa: E731
                                                                    value_bias=None), **kw})
    assert pick(*fake(128)) == "flash"
    assert pick(*fake(128, dtype=torch.float32)) == "efficient"
    assert pick(*fake(1, 300)) == "flash" and pick(*fake(40, 300)) is None  # one cached query; T < S causal
    assert pick(*fake(40, 300), causal=False) == "flash"
    assert pick(*fake(128), bias=object()) is None and pick(*fake(128), mask=object()) is None
    assert pick(*fake(128), value_bias=object()) is None
    assert pick(*fake(128, Dh=12)) is None  # neither fused kernel takes a width that is not a multiple of 8
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))
    assert pick(*fake(128)) == "efficient"
    q = torch.randn(1, 2, 16, 8)
    assert module.fused_backend(q, q, mask=None, causal=True, bias=None, value_bias=None) is None
    before = module.BACKENDS_RUN["tiled"]
    module.flash(q, q, q, mask=None, causal=True, bias=None, scale=0.3)
    assert module.BACKENDS_RUN["tiled"] == before + 1
