"""A short prompt's compiled prefill (qkv.generate.compiled.CompiledStep.prompt) against the model's own forward:
the same logits after the prompt, the same cache, the same steps after it and the same greedy text; the
model's forward wherever it does not apply (padding, a longer prompt, one token)."""

import pytest
import torch
from torch._dynamo.utils import counters

from qkv.generate import compiled, generate
from qkv.generate.compiled import PROMPT_ROWS
from qkv.nn.decoding_linear import decoding_linears
from tests.generate.test_compiled import NEEDS_CXX, MODELS, PROMPT, float64_twin, fp32_close

pytestmark = [NEEDS_CXX, pytest.mark.usefixtures("own_inductor_cache")]  # (tests/generate/conftest.py)


def close(models: dict, name: str, got: torch.Tensor, want: torch.Tensor, truth: torch.Tensor | None) -> None:
    """fp32 activations: fp32's rounding (test_compiled.fp32_close). bf16: no further from the exact math (float64, the same weights) than
    twice the general path's error plus one bf16 step (the compiled attention rounds elsewhere)."""
    if truth is None:
        fp32_close(models[name], got, want)
        return
    off, general_off = (got.double() - truth).abs().max(), (want.double() - truth).abs().max()
    assert off <= 2 * general_off + 2 ** -7 * truth.abs().max(), (off, general_off)


@pytest.mark.parametrize("name, rows", [(name, 1) for name in MODELS] + [("gpt", 2)])
def test_a_short_prompt_gives_the_general_prefills_logits_cache_and_steps(models, name, rows):
    """A first prompt, then a second one into the same cache (a chat's next turn), then decode steps."""
    model = models[name]
    step = compiled.compiled_step(model)
    exact = float64_twin(name) if MODELS[name][1] == "bf16" else None
    first = torch.tensor([PROMPT] * rows)
    second = torch.tensor([[7, 1, 12]] * rows)
    with torch.inference_mode(), decoding_linears(model):  # (as generate and a chat turn prefill)
        general, fast = model.new_cache(rows, 40), model.new_cache(rows, 40)
        reference = exact.new_cache(rows, 40) if exact is not None else None
        for ids in (first, second):
            assert step.takes_prompt(ids, None, fast)
            want = model(ids, cache=general, logits_to_keep=1)[:, -1]
            got = step.prompt(ids, fast)
            truth = exact(ids, cache=reference)[:, -1] if exact is not None else None
            close(models, name, got, want, truth)
        assert fast.length == general.length == len(PROMPT) + 3
        assert torch.equal(fast.positions[:, :fast.length], general.positions[:, :general.length])
        assert torch.equal(fast.next_position, general.next_position)
        for i, (a, b) in enumerate(zip(general.layers, fast.layers)):
            for kind in ("k", "v"):
                want, got = getattr(a, kind)[:, :, :a.length], getattr(b, kind)[:, :, :b.length]
                truth = getattr(reference.layers[i], kind)[:, :, :a.length] if exact is not None else None
                close(models, name, got, want, truth)
        token = torch.tensor([5] * rows)
        for _ in range(4):
            want = model(token[:, None], cache=general)[:, -1]
            got = step(token, fast)
            truth = exact(token[:, None], cache=reference)[:, -1] if exact is not None else None
            close(models, name, got, want, truth)
            token = want.argmax(-1)
    assert step.failed is None


def test_generate_takes_it_where_it_applies(models, monkeypatch):
    """generate's prefill takes the compiled prompt for 2..PROMPT_ROWS tokens a row without padding, with the
    same greedy tokens as without it; padding, longer prompts and a single token take the model's forward."""
    model = models["gpt"]
    step = compiled.compiled_step(model)
    taken = []
    prompt = type(step).prompt
    monkeypatch.setattr(type(step), "prompt", lambda self, ids, cache: taken.append(ids.shape) or prompt(
        self, ids, cache))

    def both(ids, **kwargs):
        with_it = generate(model, ids, max_new_tokens=6, **kwargs)
        step.failed = "off for the comparison"
        try:
            assert generate(model, ids, max_new_tokens=6, **kwargs).tolist() == with_it.tolist()
        finally:
            step.failed = None

    both(torch.tensor([PROMPT]))
    both(torch.tensor([[3, 4]]))
    assert taken == [(1, len(PROMPT)), (1, 2)]
    long = torch.arange(PROMPT_ROWS + 1)[None] % 60
    both(long)
    both(torch.tensor([[9]]))
    both(torch.tensor([[0, 3, 4], [5, 6, 7]]), attention_mask=torch.tensor([[0, 1, 1], [1, 1, 1]]))
    assert taken == [(1, len(PROMPT)), (1, 2)]  # none of those
    both(torch.tensor([[1, 3, 4], [5, 6, 7]]), attention_mask=torch.ones(2, 3, dtype=torch.long))
    assert taken[-1] == (2, 3)


def test_a_quantized_models_prompts_compile_one_graph():
    """One graph for every prompt: the int4 kernel's packed weights are made before the first compiled call, not
    inside the traced prompt (whose graph would then pack them, and the next call compile it again without), and
    a prompt into a cache that holds tokens (a chat's next turn) takes the graph traced into an empty one."""
    from torch._dynamo.utils import counters

    from tests.generate.test_compiled import LLAMA, tiny

    model = tiny("int4", **LLAMA)
    step = compiled.enable(model, summed=False)
    before = counters["stats"]["unique_graphs"]
    with torch.inference_mode():
        cache = model.new_cache(1, 40)
        for ids in (PROMPT, PROMPT[:3]):  # an empty cache, then the same one holding 6 tokens
            step.prompt(torch.tensor([ids]), cache)
        step.prompt(torch.tensor([PROMPT[:4]]), model.new_cache(1, 40))
    assert counters["stats"]["unique_graphs"] == before + 1 and step.failed is None


def test_the_compiled_step_writes_and_reads_a_sliding_layers_ring(models):
    """Gemma's shape with its sliding layers in rings (as generate and chat decode: qkv.nn.cache): the compiled
    prompt and steps equal the general step's logits while the ring wraps round, and the whole forward's."""
    model = models["gemma"]
    step = compiled.compiled_step(model)
    ids = torch.randint(0, 64, (1, 38), generator=torch.Generator().manual_seed(3))
    with torch.inference_mode(), decoding_linears(model):
        general, fast = model.new_cache(1, 40, rolling=True), model.new_cache(1, 40, rolling=True)
        assert sum(type(layer).__name__ == "RingLayerCache" for layer in fast.layers) == 2  # 4 + 16 slots each
        torch.testing.assert_close(step.prompt(ids[:, :6], fast), model(ids[:, :6], cache=general)[:, -1],
                                   rtol=1e-5, atol=1e-5)
        graphs = None
        for t in range(6, 38):
            want = model(ids[:, t:t + 1], cache=general)[:, -1]
            torch.testing.assert_close(step(ids[0, t:t + 1], fast), want, rtol=1e-5, atol=1e-5)
            if t == 6:  # (the step's graph compiled)
                graphs = counters["stats"]["unique_graphs"]
        torch.testing.assert_close(want, model(ids)[:, -1], rtol=1e-5, atol=1e-5)
    assert step.failed is None and counters["stats"]["unique_graphs"] == graphs  # one graph before and after the wrap
