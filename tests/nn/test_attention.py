import math

import pytest
import torch

from qkv.nn.attention import Attention, AttentionContext
from qkv.nn.cache import LayerCache
from qkv.nn.kernels import KERNELS
from qkv.nn.positional import ALiBi, Positional, Rotary

KERNEL_NAMES = KERNELS.names()
# Kernels that compute exact softmax attention, tested against the formula; the sparse and linear kernels
# (local, dilated, random, linear) compute other functions and have their own oracles. A new exact
# kernel adds its name here. Properties every kernel must keep (causality, cache) use KERNELS.names().
EXACT_KERNELS = [name for name in ("naive", "sdpa", "flash") if name in KERNELS]
B, T, D, H = 2, 5, 16, 4


def context(T=T, S=None, positional=None, causal=True, start=0, mask=None):
    S = T if S is None else S
    return AttentionContext(positional=positional or Positional(),
                            positions=torch.arange(start, start + T).expand(B, T),
                            key_positions=torch.arange(S).expand(B, S), mask=mask, causal=causal)


def randomise(module):
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
    return module


def hand_attention(x, attn: Attention, *, causal: bool, memory=None, kv_head_of=None):
    """Concat_h softmax(Q_h K_h^T / sqrt(Dh) + M) V_h W^O + b^O, with einsum (note 000 §2.2).
    `kv_head_of[h]` is the key/value head query head h reads (identity for MHA)."""
    source = x if memory is None else memory
    Dh = attn.head_dim
    q = (x @ attn.q_proj.weight.T + attn.q_proj.bias).unflatten(-1, (attn.n_heads, Dh))  # (B, T, H, Dh)
    k = (source @ attn.k_proj.weight.T + attn.k_proj.bias).unflatten(-1, (attn.n_kv_heads, Dh))  # (B, S, Hkv, Dh)
    v = (source @ attn.v_proj.weight.T + attn.v_proj.bias).unflatten(-1, (attn.n_kv_heads, Dh))
    if kv_head_of is not None:
        k, v = k[:, :, kv_head_of], v[:, :, kv_head_of]  # (B, S, H, Dh)
    scores = torch.einsum("bthd,bshd->bhts", q, k) / math.sqrt(Dh)
    if causal:
        Tq, S = scores.shape[-2:]
        scores = scores.masked_fill(torch.ones(Tq, S, dtype=torch.bool).triu(1 + S - Tq), -math.inf)
    weights = scores.softmax(-1)
    heads = torch.einsum("bhts,bshd->bthd", weights, v).flatten(-2)  # (B, T, H*Dh)
    return heads @ attn.o_proj.weight.T + attn.o_proj.bias


def test_projection_shapes_follow_the_head_counts():
    attn = Attention(24, 6, 2, kernel="naive", bias=True)
    assert attn.q_proj.weight.shape == (24, 24) and attn.o_proj.weight.shape == (24, 24)
    assert attn.k_proj.weight.shape == (8, 24) and attn.v_proj.weight.shape == (8, 24)
    assert Attention(24, 6, 6, kernel="naive", bias=False).q_proj.bias is None


@pytest.mark.parametrize("kernel", EXACT_KERNELS)
@pytest.mark.parametrize("causal", [True, False])
def test_mha_equals_the_einsum_formula(kernel, causal):
    attn = randomise(Attention(D, H, H, kernel=kernel, bias=True))
    x = torch.randn(B, T, D)
    expected = hand_attention(x, attn, causal=causal)
    torch.testing.assert_close(attn(x, context(causal=causal)), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kernel", EXACT_KERNELS)
@pytest.mark.parametrize("n_kv_heads", [1, 2])
def test_gqa_and_mqa_query_heads_read_their_groups_kv_head(kernel, n_kv_heads):
    attn = randomise(Attention(D, H, n_kv_heads, kernel=kernel, bias=True))
    x = torch.randn(B, T, D)
    group = H // n_kv_heads
    kv_head_of = torch.tensor([h // group for h in range(H)])  # consecutive query heads share a kv head
    expected = hand_attention(x, attn, causal=True, kv_head_of=kv_head_of)
    torch.testing.assert_close(attn(x, context()), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("n_kv_heads", [1, 2])
def test_gqa_equals_mha_with_tiled_key_value_weights(n_kv_heads):
    """GQA/MQA == an MHA whose K/V projections repeat each kv head for its group of query heads."""
    small = randomise(Attention(D, H, n_kv_heads, kernel="naive", bias=True))
    full = Attention(D, H, H, kernel="naive", bias=True)
    Dh, group = D // H, H // n_kv_heads
    state = dict(small.state_dict())
    for name in ("k_proj", "v_proj"):
        weight = state[f"{name}.weight"].view(n_kv_heads, Dh, D)
        state[f"{name}.weight"] = weight.repeat_interleave(group, dim=0).reshape(H * Dh, D)
        state[f"{name}.bias"] = state[f"{name}.bias"].view(n_kv_heads, Dh).repeat_interleave(group, 0).flatten()
    full.load_state_dict(state)
    x = torch.randn(B, T, D)
    torch.testing.assert_close(small(x, context()), full(x, context()), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("kernel", EXACT_KERNELS)
def test_self_attention_without_positions_is_permutation_equivariant(kernel):
    """SPEC claim 6: with no positions and no mask, Attn(P X) = P Attn(X)."""
    attn = randomise(Attention(D, H, H, kernel=kernel, bias=True))
    x = torch.randn(B, T, D)
    perm = torch.tensor([3, 0, 4, 1, 2])
    out = attn(x, context(causal=False))
    torch.testing.assert_close(attn(x[:, perm], context(causal=False)), out[:, perm], rtol=1e-5, atol=1e-5)


def test_attention_depends_on_the_projections():
    """SPEC claim 15: changing W^Q changes the output (attention is not invariant to the projections)."""
    attn = randomise(Attention(D, H, H, kernel="naive", bias=True))
    x = torch.randn(B, T, D)
    before = attn(x, context(causal=False))
    with torch.no_grad():
        attn.q_proj.weight.mul_(3.0)
    assert (attn(x, context(causal=False)) - before).abs().max() > 1e-3


@pytest.mark.parametrize("kernel", EXACT_KERNELS)
def test_cross_attention_takes_keys_and_values_from_memory(kernel):
    attn = randomise(Attention(D, H, H, kernel=kernel, bias=True))
    x, memory = torch.randn(B, 3, D), torch.randn(B, 7, D)
    ctx = context(T=3, S=7, causal=False)
    expected = hand_attention(x, attn, causal=False, memory=memory)
    torch.testing.assert_close(attn(x, ctx, memory=memory), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kernel", KERNEL_NAMES)
@pytest.mark.parametrize("positional", ["none", "rope", "alibi"])
@pytest.mark.parametrize("n_kv_heads", [H, 2])
def test_cached_incremental_attention_equals_the_full_pass(kernel, positional, n_kv_heads):
    pe = {"none": Positional(), "rope": Rotary(head_dim=D // H, rope_theta=10000.0), "alibi": ALiBi(n_heads=H)}
    pe = pe[positional]
    attn = randomise(Attention(D, H, n_kv_heads, kernel=kernel, bias=True, window=2))
    x = torch.randn(B, 6, D)
    full = attn(x, context(T=6, positional=pe))
    cache = LayerCache(B, n_kv_heads, 8, D // H, dtype=torch.float32, device=None)
    pieces = [attn(x[:, :3], context(T=3, positional=pe), cache)]
    for t in range(3, 6):
        ctx = AttentionContext(positional=pe, positions=torch.full((B, 1), t),
                               key_positions=torch.arange(t + 1).expand(B, t + 1), mask=None, causal=True)
        pieces.append(attn(x[:, t:t + 1], ctx, cache))
    assert cache.length == 6
    torch.testing.assert_close(torch.cat(pieces, 1), full, rtol=1e-5, atol=1e-5)


def test_cache_overflow_is_an_error():
    cache = LayerCache(1, 1, 2, 4, dtype=torch.float32, device=None)
    cache.append(torch.zeros(1, 1, 2, 4), torch.zeros(1, 1, 2, 4))
    with pytest.raises(ValueError, match="KV cache overflow: 3 > 2"):
        cache.append(torch.zeros(1, 1, 1, 4), torch.zeros(1, 1, 1, 4))


def hand_qk_norm_attention(x, attn: Attention, eps: float):
    """The einsum formula with each head's q and k replaced by g * q / sqrt(mean(q^2) + eps) (QK-norm)."""
    Dh = attn.head_dim
    q = (x @ attn.q_proj.weight.T + attn.q_proj.bias).unflatten(-1, (attn.n_heads, Dh))
    k = (x @ attn.k_proj.weight.T + attn.k_proj.bias).unflatten(-1, (attn.n_kv_heads, Dh))
    v = (x @ attn.v_proj.weight.T + attn.v_proj.bias).unflatten(-1, (attn.n_kv_heads, Dh))
    q = attn.q_norm.weight * q / torch.sqrt((q * q).mean(-1, keepdim=True) + eps)
    k = attn.k_norm.weight * k / torch.sqrt((k * k).mean(-1, keepdim=True) + eps)
    scores = torch.einsum("bthd,bshd->bhts", q, k) / math.sqrt(Dh)
    scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), -math.inf)
    heads = torch.einsum("bhts,bshd->bthd", scores.softmax(-1), v).flatten(-2)
    return heads @ attn.o_proj.weight.T + attn.o_proj.bias


@pytest.mark.parametrize("kernel", EXACT_KERNELS)
def test_qk_norm_equals_the_formula_and_is_blind_to_the_scale_of_w_q_and_w_k(kernel):
    torch.manual_seed(0)
    attn = randomise(Attention(D, H, H, kernel=kernel, bias=True, qk_norm_eps=1e-6)).double()
    x = torch.randn(B, T, D, dtype=torch.float64)
    out = attn(x, context())
    torch.testing.assert_close(out, hand_qk_norm_attention(x, attn, 1e-6), rtol=1e-10, atol=1e-10)
    with torch.no_grad():  # RMSNorm(c q) = RMSNorm(q) for c > 0 (up to eps): the logits stay bounded by the gains
        for proj in (attn.q_proj, attn.k_proj):
            proj.weight.mul_(50.0)
            proj.bias.mul_(50.0)
    torch.testing.assert_close(attn(x, context()), out, rtol=1e-6, atol=1e-6)
    assert [n for n, _ in attn.named_parameters() if "norm" in n] == ["q_norm.weight", "k_norm.weight"]
