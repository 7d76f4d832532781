"""qkv.plan: a decoder's layers one by one. Each kind of layer against its formula (a sliding layer's
keys, a nope layer's missing rotation, a local base), the cached decode (sliding layers in rings) equal to the
whole forward far past the window, one row and a left-padded batch, a chat cut back within the ring, and the
ring's memory, measured, equal to `qkv calc`'s figure (Gemma 3 270M's shape at 8,192 tokens)."""
import math

import pytest
import torch

import qkv
from qkv.analysis import memory
from qkv.errors import QkvError
from qkv.nn.cache import RingLayerCache
from qkv.plan import RING_SPARE, layer_plans
from qkv.nn.kernels import naive

PLANNED = dict(vocab_size=50, d_model=32, n_heads=4, n_kv_heads=2, head_size=12, n_layers=4, d_ff=48,
               max_seq_len=96, positional="rope", norm="rmsnorm", norm_placement="sandwich", ffn="glu",
               activation="gelu_tanh", bias=False, qk_norm=True, embed_scale=True, query_scale=10.0,
               layer_types=("sliding", "global", "nope", "sliding"), sliding_window=5, rope_local_theta=100.0,
               rope_theta=10000.0, init_std=0.2)


def planned(**overrides) -> torch.nn.Module:
    torch.manual_seed(0)
    return qkv.build_model(qkv.ModelConfig(**{**PLANNED, **overrides})).eval()


def test_the_plan_names_each_layer():
    plans = layer_plans(qkv.ModelConfig(**PLANNED))
    assert [p.kind for p in plans] == ["sliding", "global", "nope", "sliding"]
    assert [p.window for p in plans] == [5, 0, 0, 5]
    assert [p.rope_theta for p in plans] == [100.0, None, None, 100.0]
    model = planned()
    assert model.blocks[0].attn.positional is model.blocks[3].attn.positional  # one rotation a kind, shared
    assert model.blocks[1].attn.positional is None and model.blocks[0].attn.positional.theta == 100.0


@pytest.mark.parametrize("fields, message", [
    (dict(layer_types=("sliding", "ring", "nope", "global")), "model.layer_types[1]='ring' is not a layer kind"),
    (dict(positional="learned"), "model.layer_types needs model.positional='rope'"),
    (dict(layer_types=(), sliding_window=5, rope_local_theta=0.0), "model.sliding_window=5 but no layer is sliding"),
    (dict(attention="local", window=3), "soft-capped scores, attention sinks and a per-layer plan"),
    (dict(rope_scaling="llama3"), "model.rope_scaling='llama3' needs model.rope_original_context >= 1"),
])
def test_a_plan_that_cannot_be_built_is_refused_naming_the_field(fields, message):
    with pytest.raises(QkvError, match=message.replace("[", r"\[").replace("]", r"\]").replace("(", r"\(")):
        qkv.build_model(qkv.ModelConfig(**{**PLANNED, **fields}))


def test_a_sliding_layer_sees_its_last_w_keys_and_a_nope_layer_does_not_rotate():
    """One layer's output against softmax(q k^T s + M) v written out, M allowing i - W < j <= i."""
    model = planned()
    x = torch.randn(2, 11, 32)
    with torch.no_grad():
        for index, rotate in ((0, True), (2, False)):
            attn = model.blocks[index].attn
            q = attn.split_heads(attn.q_proj(x), 4)
            k = attn.repeat_kv(attn.split_heads(attn.k_proj(x), 2))
            v = attn.repeat_kv(attn.split_heads(attn.v_proj(x), 2))
            q, k = attn.q_norm(q), attn.k_norm(k)
            if rotate:
                q, k = attn.positional.rotate(q, k, torch.arange(11).expand(2, 11))
            i, j = torch.arange(11)[:, None], torch.arange(11)[None, :]
            allowed = (j <= i) & (j > i - 5 if attn.sliding else True)
            out = naive(q, k, v, mask=allowed[None, None], causal=False, bias=None, scale=10.0 ** -0.5)
            want = attn.o_proj(out.transpose(1, 2).reshape(2, 11, 48))
            from qkv.models.context import self_context
            got = attn(x, self_context(model.positional, torch.zeros(2, 11, dtype=torch.long), None, None, causal=True))
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_ring_decoding_equals_the_whole_forward_far_past_the_window():
    model = planned()
    ids = torch.randint(0, 50, (1, 40))
    with torch.no_grad():
        whole = model(ids)
        cache = model.new_cache(1, 96, rolling=True)
        assert [type(layer).__name__ for layer in cache.layers] == ["RingLayerCache", "LayerCache", "LayerCache",
                                                                   "RingLayerCache"]
        steps = [model(ids[:, :7], cache=cache)]  # a prompt, then one token at a time
        steps += [model(ids[:, t:t + 1], cache=cache) for t in range(7, 40)]
    torch.testing.assert_close(torch.cat(steps, 1), whole, rtol=1e-5, atol=1e-5)
    assert cache.layers[0].k.shape[2] == 5 + RING_SPARE


def test_a_left_padded_batch_decodes_each_row_as_alone():
    model = planned()
    rows = [torch.randint(0, 50, (n,)) for n in (30, 24)]
    prompt = torch.zeros(2, 30, dtype=torch.long)
    mask = torch.zeros(2, 30, dtype=torch.long)
    for b, row in enumerate(rows):
        prompt[b, 30 - len(row):], mask[b, 30 - len(row):] = row, 1
    out = qkv.generate(model, prompt, attention_mask=mask, max_new_tokens=25, strategy="greedy")
    for b, row in enumerate(rows):
        alone = qkv.generate(model, row[None], max_new_tokens=25, strategy="greedy")
        assert out[b, 30:].tolist() == alone[0, len(row):].tolist()


def test_a_chat_cut_back_within_the_ring_or_begun_again():
    from qkv.generate.chat import ChatSession  # noqa: F401 (the session's feed uses can_truncate)

    model = planned()
    ids = torch.randint(0, 50, (1, 60))
    with torch.no_grad():
        cache = model.new_cache(1, 96, rolling=True)
        model(ids[:, :50], cache=cache)
        assert cache.can_truncate(48) and not cache.can_truncate(20)  # 20: its window's keys overwritten
        cache.truncate(48, int(ids[0, 47]))
        got = model(ids[:, 48:60], cache=cache)
        torch.testing.assert_close(got, model(ids[:, :60])[:, 48:], rtol=1e-5, atol=1e-5)


def test_the_rings_bytes_are_calcs_at_gemma_3s_shape():
    """Gemma 3 270M's attention (18 layers, every sixth global, 512-key windows, one KV head of 256) at 8,192
    tokens: the cache built for a chat against an all-global one, both as `qkv calc` gives them."""
    kinds = tuple("global" if (i + 1) % 6 == 0 else "sliding" for i in range(18))
    gemma = dict(vocab_size=64, d_model=640, n_heads=4, n_kv_heads=1, head_size=256, n_layers=18, d_ff=8,
                 max_seq_len=8192, positional="rope", norm="rmsnorm", ffn="glu", bias=False, layer_types=kinds,
                 sliding_window=512, rope_local_theta=10000.0)
    cfg = qkv.ModelConfig(**gemma)
    with torch.device("meta"):
        model = qkv.build_model(cfg)
    model.tok_emb.weight = torch.nn.Parameter(torch.empty(64, 640))  # (new_cache reads its dtype and device)
    cache = model.new_cache(1, 8192, rolling=True)
    built = sum(layer.k.numel() * layer.k.element_size() * 2 for layer in cache.layers)
    assert sum(isinstance(layer, RingLayerCache) for layer in cache.layers) == 15
    assert built == memory.kv_cache(cfg, batch=1, seq=8192, bytes_per_element=4)
    everything = memory.kv_cache(qkv.ModelConfig(**{**gemma, "layer_types": (), "sliding_window": 0,
                                                    "rope_local_theta": 0.0}), batch=1, seq=8192, bytes_per_element=4)
    assert everything == 18 * 8192 * 2 * 256 * 4  # 302 MB in fp32
    assert built == (3 * 8192 + 15 * (512 + RING_SPARE)) * 2 * 256 * 4  # 66 MB: 4.6x less
    assert math.isclose(everything / built, 4.58, rel_tol=0.01)
