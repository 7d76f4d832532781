"""Relative positional encodings against their closed forms (note 000 §15.3; T5), written as loops over
(b, h, i, j) from the papers' formulas, and Transformer-XL's segment memory through the KV cache."""
import dataclasses
import math

import pytest
import torch

from qkv.config import ModelConfig
from qkv.models import build_model
from qkv.nn.attention import Attention, AttentionContext
from qkv.nn.cache import LayerCache
from qkv.nn.kernels import RelativeValues, naive
from qkv.nn.positional import POSITIONALS, sinusoidal_table
from qkv.nn.relative import T5_BUCKETS, t5_bucket

H, DH, D = 2, 4, 8


def make(name, **overrides):
    dims = dict(d_model=D, n_heads=H, head_dim=DH, max_seq_len=64, rope_theta=10000.0, max_distance=3)
    pe = POSITIONALS.get(name)(**{**dims, **overrides}).double()
    with torch.no_grad():
        for p in pe.parameters():
            p.copy_(torch.randn_like(p))
    return pe


POSITIONS = (torch.tensor([[0, 1, 2, 3, 4, 5, 6], [3, 4, 5, 6, 7, 8, 9]]),  # queries (B, T)
             torch.tensor([[0, 1, 2, 3, 4, 5, 6], [0, 1, 2, 3, 4, 5, 6]]))  # keys (B, S): row 1 is a cache step


def q_and_k(T=7, S=7):
    return torch.randn(2, H, T, DH, dtype=torch.float64), torch.randn(2, H, S, DH, dtype=torch.float64)


# ------------------------------------------------------------------------------------------ Shaw


def test_shaw_bias_and_value_term_equal_the_papers_formulas():
    """e_ij = q_i . (k_j + w^K_clip(j-i,-k,k)) / sqrt(Dh); z_i = sum_j a_ij (v_j + w^V_clip(j-i,-k,k))."""
    pe = make("shaw", max_distance=3)
    q, k = q_and_k()
    v = torch.randn(2, H, 7, DH, dtype=torch.float64)
    qp, kp = POSITIONS
    bias = pe.score_bias(qp, kp, q, k)
    values = pe.value_bias(qp, kp)
    assert isinstance(values, RelativeValues)
    out = naive(q, k, v, mask=None, causal=False, bias=bias, scale=DH ** -0.5, value_bias=values)
    wk, wv = pe.key_table.weight, pe.value_table.weight  # (7, Dh): rows for offsets -3..3
    for b in range(2):
        for h in range(H):
            for i in range(7):
                clip = [max(-3, min(3, int(kp[b, j] - qp[b, i]))) + 3 for j in range(7)]
                scores = torch.stack([q[b, h, i] @ (k[b, h, j] + wk[clip[j]]) for j in range(7)]) / math.sqrt(DH)
                weights = scores.softmax(-1)
                expected = sum(weights[j] * (v[b, h, j] + wv[clip[j]]) for j in range(7))
                torch.testing.assert_close(bias[b, h, i] + (k[b, h] @ q[b, h, i]) / math.sqrt(DH), scores,
                                           rtol=1e-12, atol=1e-12)
                torch.testing.assert_close(out[b, h, i], expected, rtol=1e-12, atol=1e-12)


def test_shaw_offsets_beyond_the_clip_distance_share_one_embedding():
    pe = make("shaw", max_distance=2)
    index = pe.relative_index(torch.tensor([[10]]), torch.arange(0, 15)[None])
    assert index[0, 0].tolist() == [0] * 9 + [1, 2, 3, 4] + [4, 4]  # j - i = -10 .. 4, clipped to -2 .. 2


# ------------------------------------------------------------------------------------------ Transformer-XL


def test_xl_score_equals_the_four_terms_of_dai_et_al():
    """A_ij = [q_i.k_j + q_i.W_R R_{i-j} + u.k_j + v.W_R R_{i-j}] / sqrt(Dh), term by term."""
    pe = make("xl")
    q, k = q_and_k()
    qp, kp = POSITIONS
    bias = pe.score_bias(qp, kp, q, k)
    W = pe.r_proj.weight.view(H, DH, D)
    u, v = pe.content_bias, pe.position_bias
    for b in range(2):
        for h in range(H):
            for i in range(7):
                for j in range(7):
                    R = sinusoidal_table(torch.tensor(float(qp[b, i] - kp[b, j])), D, dtype=torch.float64)  # (D,)
                    terms = q[b, h, i] @ (W[h] @ R) + u[h] @ k[b, h, j] + v[h] @ (W[h] @ R)
                    assert bias[b, h, i, j].item() == pytest.approx(terms.item() / math.sqrt(DH), abs=1e-12)


def test_xl_depends_on_distances_only():
    pe = make("xl")
    q, k = q_and_k()
    base = torch.arange(7)[None].expand(2, 7)
    torch.testing.assert_close(pe.score_bias(base + 100, base + 100, q, k), pe.score_bias(base, base, q, k),
                               rtol=1e-10, atol=1e-10)


def tiny(positional, **changes):
    torch.manual_seed(1)
    cfg = ModelConfig(vocab_size=32, d_model=16, n_heads=4, n_layers=2, d_ff=32, max_seq_len=64,
                      positional=positional, attention="naive", window=2)
    return build_model(dataclasses.replace(cfg, **changes)).eval()


@pytest.mark.parametrize("attention", ["naive", "local"])
def test_xl_segment_memory_is_the_previous_segments_cache(attention):
    """Segment 2 run on the cache segment 1 filled == the last rows of one pass over both (relative
    distances reach into the memory); after keep_last(M) it equals the pass with the dropped columns
    masked out as padding."""
    model = tiny("xl", attention=attention)
    ids = torch.randint(0, 32, (2, 10))
    with torch.no_grad():
        full = model(ids)
        memory = model.new_cache(2, 16)
        model(ids[:, :6], cache=memory)
        torch.testing.assert_close(model(ids[:, 6:], cache=memory), full[:, 6:], rtol=1e-5, atol=1e-5)

        kept, masked = model.new_cache(2, 16), model.new_cache(2, 16)
        model(ids[:, :6], cache=kept)
        model(ids[:, :6], cache=masked)
        kept.keep_last(3)
        masked.padding[:, :3], masked.padded = False, True  # the 3 oldest columns hidden from later queries
        assert kept.length == 3 and kept.positions[:, :3].tolist() == [[3, 4, 5]] * 2
        torch.testing.assert_close(model(ids[:, 6:], cache=kept), model(ids[:, 6:], cache=masked),
                                   rtol=1e-5, atol=1e-5)


def test_xl_training_over_segments_stops_gradients_at_the_memory():
    model = tiny("xl").train()
    ids = torch.randint(0, 32, (2, 12))
    memory = model.new_cache(2, 12)
    for segment in (ids[:, :6], ids[:, 6:]):
        model.zero_grad()
        logits = model(segment, cache=memory)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), segment.roll(-1, 1).flatten())
        loss.backward()  # the second segment would fail here ("backward through the graph a second time")
        memory.detach()  # ... without this stop-gradient
        assert model.positional.content_bias.grad.abs().sum() > 0


# ------------------------------------------------------------------------------------------ T5


def t5_bucket_scalar(rel: int, bidirectional: bool, num_buckets: int = 32, max_distance: int = 128) -> int:
    """T5's bucket of one relative position j - i, as in the T5 / mesh-tensorflow source."""
    bucket = 0
    if bidirectional:
        num_buckets //= 2
        bucket += num_buckets if rel > 0 else 0
        n = abs(rel)
    else:
        n = max(-rel, 0)
    max_exact = num_buckets // 2
    if n < max_exact:
        return bucket + n
    large = max_exact + int(math.log(n / max_exact) / math.log(max_distance / max_exact) * (num_buckets - max_exact))
    return bucket + min(large, num_buckets - 1)


@pytest.mark.parametrize("bidirectional", [True, False])
@pytest.mark.parametrize("max_distance", [128, 20])
def test_t5_buckets_equal_the_scalar_definition(bidirectional, max_distance):
    rel = torch.arange(-300, 301)
    buckets = t5_bucket(rel, bidirectional=bidirectional, num_buckets=32, max_distance=max_distance)
    expected = [t5_bucket_scalar(int(r), bidirectional, 32, max_distance) for r in rel]
    assert buckets.tolist() == expected


def test_t5_known_buckets_and_a_max_distance_inside_the_exact_range():
    bi = t5_bucket(torch.tensor([0, -1, 1, -7, -8, -127, -1000, 5]), bidirectional=True, num_buckets=32,
                   max_distance=128)
    assert bi.tolist() == [0, 1, 17, 7, 8, 15, 15, 21]
    causal = t5_bucket(torch.tensor([3, 0, -15, -16, -40]), bidirectional=False, num_buckets=32, max_distance=16)
    assert causal.tolist() == [0, 0, 15, 31, 31]  # max_exact = 16 = max_distance: beyond it, the last bucket


@pytest.mark.parametrize("name, bidirectional", [("t5", True), ("t5_causal", False)])
def test_t5_bias_is_the_learnt_scalar_of_each_heads_bucket(name, bidirectional):
    pe = make(name, max_distance=16)
    qp, kp = POSITIONS
    bias = pe.score_bias(qp, kp)
    table = pe.relative_attention_bias.weight  # (buckets, H)
    assert table.shape == (T5_BUCKETS, H)
    for b in range(2):
        for i in range(7):
            for j in range(7):
                bucket = t5_bucket_scalar(int(kp[b, j] - qp[b, i]), bidirectional, T5_BUCKETS, 16)
                torch.testing.assert_close(bias[b, :, i, j], table[bucket], rtol=0, atol=0)


# ------------------------------------------------------------------------------------------ every positional


@pytest.mark.parametrize("name", POSITIONALS.names())
def test_cached_attention_equals_the_full_pass_for_every_positional(name):
    """Biases from positions (not columns): a cache step with the prefix's keys == the full pass's rows."""
    pe = make(name, d_model=16, n_heads=4, head_dim=4).float()
    attn = Attention(16, 4, 2, kernel="flash", bias=True)
    x = torch.randn(2, 6, 16)

    def ctx(T, start, S):
        return AttentionContext(pe, torch.arange(start, start + T).expand(2, T), torch.arange(S).expand(2, S),
                                None, True)

    embedded = pe.embed(x, torch.arange(6).expand(2, 6))
    full = attn(embedded, ctx(6, 0, 6))
    cache = LayerCache(2, 2, 6, 4, dtype=torch.float32, device=None)
    pieces = [attn(embedded[:, :4], ctx(4, 0, 4), cache), attn(embedded[:, 4:5], ctx(1, 4, 5), cache),
              attn(embedded[:, 5:], ctx(1, 5, 6), cache)]
    torch.testing.assert_close(torch.cat(pieces, 1), full, rtol=1e-5, atol=1e-5)
