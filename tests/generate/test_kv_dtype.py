"""`--kv-dtype fp16|bf16`: a decoder's KV cache holding keys and values rounded to half precision as they are
written (qkv.generate.weights.set_kv_dtype).

Oracle: the same model without a cache, its K and V rounded to that dtype at their hook points (qkv.nn.hookpoints:
after RoPE, what the cache stores): a prompt and every token after it through the half cache give the logits of
that forward to fp32's rounding (up to a half-precision ulp of a key where the two paths round on either side
of a boundary), eagerly, with a rolling cache (a local kernel) and through the compiled step."""
import pytest
import torch

import qkv
from qkv.errors import QkvError
from qkv.generate import compiled
from qkv.generate.weights import set_kv_dtype
from qkv.nn.decoding_linear import decoding_linears
from qkv.nn.hookpoints import hooked
from tests.generate.test_compiled import LLAMA, NEEDS_CXX, tiny

IDS = [3, 14, 15, 9, 2, 6, 5, 35, 8, 9, 7, 9, 3, 2, 38, 4]
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


def rounded_forward(model, ids: list[int], dtype: torch.dtype) -> torch.Tensor:
    """Logits (T, V) of the whole sequence without a cache, each layer's K and V rounded to `dtype`."""
    round_trip = lambda t, name: t.to(dtype).to(t.dtype)  # noqa: E731
    hooks = [(f"blocks.{i}.attn.{kind}", round_trip) for i in range(len(model.blocks)) for kind in ("k", "v")]
    with torch.no_grad(), hooked(model, hooks):
        return model(torch.tensor([ids]))[0]


def cached_logits(model, ids: list[int], prompt: int, rolling: bool = False) -> torch.Tensor:
    """Logits (T, V): the first `prompt` tokens in one call, then one token a call, through the model's cache."""
    with torch.no_grad():
        cache = model.new_cache(1, 40, rolling=rolling)
        rows = [model(torch.tensor([ids[:prompt]]), cache=cache)[0]]
        for token in ids[prompt:]:
            rows.append(model(torch.tensor([[token]]), cache=cache)[0])
    return torch.cat(rows)


@pytest.mark.parametrize("name", list(DTYPES))
@pytest.mark.parametrize("family", ["llama", "local"])
def test_a_half_cache_equals_rounding_k_and_v(name, family):
    model = tiny("none", "fp32", **LLAMA, **({"attention": "local", "window": 4} if family == "local" else {}))
    plain = cached_logits(model, IDS, prompt=6, rolling=family == "local")
    assert set_kv_dtype(model, name) is not None
    cache = model.new_cache(1, 40, rolling=family == "local")
    assert {layer.k.dtype for layer in cache.layers} == {DTYPES[name]}
    got = cached_logits(model, IDS, prompt=6, rolling=family == "local")
    want = rounded_forward(model, IDS, DTYPES[name])
    # fp32's rounding (the fp32 cache against the fp32 forward: up to 1.1e-5 here), and where the two paths' K
    # differ by fp32's rounding across a half-precision rounding boundary, one ulp of that key (up to 1.0e-4 here)
    torch.testing.assert_close(got, want, rtol=0, atol=5e-4)
    assert (got - plain).abs().max() > 10 * (got - want).abs().max()  # the rounding is there, and much larger
    if family == "local":  # the rolling cache kept its dtype as it rolled
        cache = model.new_cache(1, 40, rolling=True)
        with torch.no_grad():
            for token in IDS:
                model(torch.tensor([[token]]), cache=cache)
        assert {layer.k.dtype for layer in cache.layers} == {DTYPES[name]}
        assert cache.layers[0].k.shape[2] < len(IDS)


@NEEDS_CXX
@pytest.mark.usefixtures("own_inductor_cache")
def test_the_compiled_step_reads_and_writes_a_half_cache(models):
    """int8 weights (the case the option is for) with an fp16 cache: the compiled prompt graph (index_copy_ into
    the cache) and token graph give the general step's logits, to the same bound as above. The session's
    compiled model (tests/generate/conftest.py), its caches back to fp32 after."""
    model = models["llama-int8"]
    step = compiled.compiled_step(model)
    set_kv_dtype(model, "fp16")
    try:
        with torch.inference_mode(), decoding_linears(model):  # (as generate decodes)
            general, fast = model.new_cache(1, 40), model.new_cache(1, 40)
            want = model(torch.tensor([IDS[:6]]), cache=general)[:, -1]
            got = step.prompt(torch.tensor([IDS[:6]]), fast)
            torch.testing.assert_close(got, want, rtol=0, atol=5e-4)
            for token in IDS[6:12]:
                assert step.usable(fast)
                want = model(torch.tensor([[token]]), cache=general)[:, -1]
                got = step(torch.tensor([token]), fast)
                torch.testing.assert_close(got, want, rtol=0, atol=5e-4)
        assert step.failed is None
        assert {layer.k.dtype for layer in fast.layers} == {layer.v.dtype for layer in fast.layers} == {torch.float16}
        for a, b in zip(general.layers, fast.layers):
            torch.testing.assert_close(b.k[:, :, :12].float(), a.k[:, :, :12].float(), rtol=2 ** -10, atol=1e-5)
    finally:
        model.kv_dtype = None


def test_set_kv_dtype_refuses_what_does_not_apply():
    model = tiny("none", "fp32", **LLAMA)
    assert set_kv_dtype(model, None) is None and model.kv_dtype is None
    assert set_kv_dtype(model, "fp32") is None and model.kv_dtype is None  # the model's own: nothing changes
    with pytest.raises(QkvError, match="--kv-dtype 'fp8'"):
        set_kv_dtype(model, "fp8")
    torch.manual_seed(0)
    seq2seq = qkv.build_model(qkv.ModelConfig(arch="encoder-decoder", vocab_size=64, d_model=32, n_heads=4,
                                              n_layers=2, d_ff=64, max_seq_len=16))
    with pytest.raises(QkvError, match="decoder-only"):
        set_kv_dtype(seq2seq, "fp16")
