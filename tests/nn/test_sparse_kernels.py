"""Every kernel against its explicit form: naive softmax attention with the kernel's pattern in the mask
(sparse kinds, flash), the explicit O(n^2) form (linear attention); the patterns against their definitions
(note 000 §15.1) written as loops; values, value terms and gradients. Parametrised over KERNELS.names(), so
a new kernel is tested here once it is registered with its KernelSpec; the spec's facts are checked too."""
import math

import pytest
import torch

from qkv.nn import flash as flash_module
from qkv.nn.kernels import KERNELS, RelativeValues, attention_weights, kernel_for, naive, weights_for
from qkv.nn.linear_attention import linear_weights
from qkv.nn.masks import causal_mask
from qkv.nn.sparse import GLOBAL_KEYS, RANDOM_KEYS, RANDOM_SPAN, random_distances

NAMES = KERNELS.names()
WINDOW = 2


@pytest.fixture(autouse=True)
def small_tiles(monkeypatch):
    """Tiles of 3 keys: a 10-key sequence crosses several tiles, partial last tile included."""
    monkeypatch.setattr(flash_module, "BLOCK", 3)


def qkv(T, S, B=2, H=2, Dh=4, dtype=torch.float64):
    return (torch.randn(B, H, T, Dh, dtype=dtype), torch.randn(B, H, S, Dh, dtype=dtype),
            torch.randn(B, H, S, Dh, dtype=dtype))


def padding_mask(T, S, pads=(0, 3)):
    """Left padding of `pads[b]` key columns per row, causal, each query sees its own column (as masks.py)."""
    keys = torch.ones(len(pads), S, dtype=torch.bool)
    for b, p in enumerate(pads):
        keys[b, :p] = False
    own = torch.arange(S)[None, :] == torch.arange(S - T, S)[:, None]
    return (keys[:, None, None, :] & causal_mask(T, S)) | own


CASES = {
    "full": dict(),
    "causal": dict(causal=True),
    "padded": dict(mask=True),
    "bias+causal": dict(bias=True, causal=True),
    "value+causal": dict(value=True, causal=True),
    "all": dict(bias=True, mask=True, value=True),
}


def case_inputs(case, T, S):
    spec = CASES[case]
    q, k, v = qkv(T, S)
    kwargs = dict(mask=padding_mask(T, S) if spec.get("mask") else None, causal=spec.get("causal", False),
                  bias=torch.randn(2, 2, T, S, dtype=torch.float64) if spec.get("bias") else None,
                  scale=0.5)
    if spec.get("value"):
        index = torch.randint(0, 5, (2, T, S))
        kwargs["value_bias"] = RelativeValues(index, torch.randn(5, 4, dtype=torch.float64))
    return q, k, v, kwargs


def explicit(name, q, k, v, *, value_bias=None, **kwargs):
    """out_i = sum_j A_ij (v_j + table[index_ij]), with A the kernel's explicit weights, by einsum."""
    weights = weights_for(name, window=WINDOW)(q, k, **kwargs)
    out = weights @ v
    if value_bias is not None:
        out = out + torch.einsum("bhts,btsd->bhtd", weights, value_bias.table[value_bias.index])
    return out


# T < S are KV-cache steps (queries are the last T columns); non-causal linear attention has no cached
# decoding, so that combination is not generated
KERNEL_CASES = [(name, case, T, S) for name in NAMES for case in CASES for T, S in [(10, 10), (4, 10), (1, 9)]
                if not (name == "linear" and case == "full" and T < S)]


@pytest.mark.parametrize("name, case, T, S", KERNEL_CASES)
def test_every_kernel_equals_its_explicit_form_in_values_and_gradients(name, case, T, S):
    """T < S are KV-cache steps (queries are the last T columns)."""
    q, k, v, kwargs = case_inputs(case, T, S)
    for tensor in (q, k, v):
        tensor.requires_grad_(True)
    upstream = torch.randn(2, 2, T, 4, dtype=torch.float64)
    out = kernel_for(name, window=WINDOW)(q, k, v, **kwargs)
    expected = explicit(name, q, k, v, **kwargs)
    torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-10)
    grads = torch.autograd.grad(out, (q, k, v), upstream)
    grads_expected = torch.autograd.grad(expected, (q, k, v), upstream)
    for got, want in zip(grads, grads_expected):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("name", NAMES)
def test_spec_facts_hold_for_the_weights(name):
    """full: the weights are naive softmax attention's; exact: each row is a softmax of scores over the keys it
    sees; reach: a causal query reads no key more than reach(w) columns back; windowed: the window matters."""
    spec = KERNELS.get(name)
    T = S = 10
    q, k, _ = qkv(T, S)
    weights = weights_for(name, window=WINDOW)(q, k, mask=None, causal=True, bias=None, scale=0.5)
    dense = attention_weights(q, k, mask=None, causal=True, bias=None, scale=0.5)
    assert torch.allclose(weights, dense, atol=1e-12) == spec.full
    seen = weights > 0
    renormalised = torch.where(seen, dense, 0.0) / torch.where(seen, dense, 0.0).sum(-1, keepdim=True)
    assert torch.allclose(weights, renormalised, atol=1e-12) == spec.exact
    if spec.reach is not None:
        distance = torch.arange(S)[:, None] - torch.arange(S)[None, :]  # query column - key column
        assert not seen[..., distance > spec.reach(WINDOW)].any()
        assert seen[..., distance == spec.reach(WINDOW)].all()
    wider = weights_for(name, window=WINDOW + 2)(q, k, mask=None, causal=True, bias=None, scale=0.5)
    assert (not torch.allclose(weights, wider)) == spec.windowed


# ------------------------------------------------------------------------------------------ patterns by loops


def allowed_by_definition(name, T, S, causal=True):
    """The keys each query may see, written from note 000 §15.1 with i, j absolute columns."""
    allowed = torch.zeros(T, S, dtype=torch.bool)
    distances = random_distances(WINDOW)
    for t in range(T):
        i = S - T + t
        for j in range(S):
            if causal and j > i:
                continue
            if name == "local":
                allowed[t, j] = abs(i - j) <= WINDOW
            elif name == "dilated":
                allowed[t, j] = (i - j) % WINDOW == 0
            elif name == "random":
                allowed[t, j] = abs(i - j) <= WINDOW or abs(i - j) in distances or j < GLOBAL_KEYS
    return allowed


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("name", ["local", "dilated", "random"])
def test_sparse_weights_are_naive_with_the_pattern_mask(name, causal):
    T = S = 40  # long enough for random distances up to WINDOW + RANDOM_SPAN to appear
    q, k, _ = qkv(T, S, B=1)
    allowed = allowed_by_definition(name, T, S, causal)
    weights = weights_for(name, window=WINDOW)(q, k, mask=None, causal=causal, bias=None, scale=0.5)
    expected = naive_weights(q, k, allowed)
    torch.testing.assert_close(weights, expected, rtol=1e-12, atol=1e-12)
    assert torch.equal(weights[0, 0] > 0, allowed)


def naive_weights(q, k, allowed):
    scores = (q @ k.transpose(-2, -1) * 0.5).masked_fill(~allowed, -math.inf)
    return scores.softmax(-1)


def test_random_distances_are_seeded_and_in_range():
    distances = random_distances(WINDOW)
    assert distances == random_distances(WINDOW) and len(set(distances)) == RANDOM_KEYS
    assert all(WINDOW < d <= WINDOW + RANDOM_SPAN for d in distances)


def test_random_global_keys_are_each_rows_first_real_keys():
    """A left-padded row's global keys are its own first tokens, not the pad columns."""
    T = S = 12
    q, k, _ = qkv(T, S, B=2)
    mask = padding_mask(T, S, pads=(0, 4))
    weights = weights_for("random", window=0)(q, k, mask=mask, causal=False, bias=None, scale=0.5)
    last = weights[1, 0, -1]  # the last query of the padded row
    assert (last[4:4 + GLOBAL_KEYS] > 0).all() and (last[:4] == 0).all()
    unpadded = weights_for("random", window=0)(q[:1, :, 4:], k[:1, :, 4:], mask=None, causal=True, bias=None,
                                               scale=0.5)
    assert torch.equal(weights[1, :, -1, 4:] > 0, unpadded[0, :, -1] > 0)


def test_local_never_builds_a_query_by_key_array(monkeypatch):
    """The band kernel forms (B, H, T/b, b, b + 2w) scores: nothing of T x S size reaches softmax."""
    shapes = []
    original = torch.Tensor.softmax

    def spy(self, *args, **kwargs):
        shapes.append(tuple(self.shape))
        return original(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "softmax", spy)
    q, k, v = qkv(64, 64, B=1, H=1)
    kernel_for("local", window=4)(q, k, v, mask=None, causal=True, bias=None, scale=0.5)
    assert shapes == [(1, 1, 16, 4, 12)]


# ------------------------------------------------------------------------------------------ linear attention


def linear_loops(q, k, v, causal):
    """O_i = sum_j phi(q_i).phi(k_j) v_j / sum_j phi(q_i).phi(k_j) over the keys i sees (note 000 §15.2)."""
    phi = lambda x: torch.where(x > 0, x + 1, torch.exp(x))  # noqa: E731
    B, H, T, _ = q.shape
    S = k.shape[2]
    out = torch.zeros(B, H, T, v.shape[-1], dtype=v.dtype)
    for b in range(B):
        for h in range(H):
            for t in range(T):
                keys = range(S - T + t + 1) if causal else range(S)
                sims = torch.stack([phi(q[b, h, t]) @ phi(k[b, h, j]) for j in keys])
                out[b, h, t] = (sims[:, None] * v[b, h, list(keys)]).sum(0) / sims.sum()
    return out


@pytest.mark.parametrize("causal", [True, False])
def test_linear_attention_equals_its_sum_form(causal, monkeypatch):
    monkeypatch.setattr("qkv.nn.linear_attention.CHUNK", 3)  # several chunks and a partial one
    q, k, v = qkv(7, 7)
    out = KERNELS.get("linear").fn(q, k, v, mask=None, causal=causal, bias=None, scale=0.5)
    torch.testing.assert_close(out, linear_loops(q, k, v, causal), rtol=1e-12, atol=1e-12)
    weights = linear_weights(q, k, mask=None, causal=causal, bias=None)
    torch.testing.assert_close(out, weights @ v, rtol=1e-12, atol=1e-12)


def test_linear_attention_is_not_softmax_attention():
    q, k, v = qkv(6, 6)
    out = KERNELS.get("linear").fn(q, k, v, mask=None, causal=True, bias=None, scale=0.5)
    assert (out - naive(q, k, v, mask=None, causal=True, bias=None, scale=0.5)).abs().max() > 1e-3


# ------------------------------------------------------------------------------------------ flash


@pytest.mark.parametrize("T, S", [(10, 10), (3, 10)])
def test_flash_equals_naive_in_float32_across_tiles(T, S):
    q, k, v = qkv(T, S, dtype=torch.float32)
    bias = torch.randn(2, 2, T, S)
    for causal in (True, False):
        out = KERNELS.get("flash").fn(q, k, v, mask=None, causal=causal, bias=bias, scale=0.5)
        torch.testing.assert_close(out, naive(q, k, v, mask=None, causal=causal, bias=bias, scale=0.5),
                                   rtol=1e-5, atol=1e-6)


def test_flash_with_dropout_keeps_the_normaliser():
    """Dropout acts on the normalised weights (the running sum l keeps every term), so it is unbiased:
    the mean over many draws approaches the output without dropout (std of the mean ~0.02 here)."""
    q, k, v = qkv(4, 4, B=1, H=1)
    exact = KERNELS.get("flash").fn(q, k, v, mask=None, causal=True, bias=None, scale=0.5)
    draws = KERNELS.get("flash").fn(*(x.expand(2000, 1, 4, 4) for x in (q, k, v)), mask=None, causal=True,
                                 bias=None, scale=0.5, dropout=0.5)  # 2000 independent draws in one batch
    torch.testing.assert_close(draws.mean(0, keepdim=True), exact, rtol=0, atol=0.1)
    assert (draws[0] - exact).abs().max() > 0.05  # a single draw does differ
