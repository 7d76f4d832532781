"""The compiled step's graphs hold the model's weights (qkv.generate.watch): a weight written in place is read as
it is then; one set anew in its place, or a quantized layer's new codes, sends the step to the general path (the
graphs would still read the old tensors) until compiled.enable() traces graphs for them."""

import pytest
import torch
from torch import nn

from qkv.generate import compiled
from qkv.nn.decoding_linear import decoding_linears
from tests.generate.test_compiled import NEEDS_CXX, LLAMA, PROMPT, tiny

pytestmark = [NEEDS_CXX, pytest.mark.usefixtures("own_inductor_cache")]  # (tests/generate/conftest.py)


def steps_against_general(model: nn.Module, count: int = 4, change=None) -> tuple[list[bool], float]:
    """Decode `count` tokens after PROMPT twice, by next_logits (the compiled step wherever usable) and by the
    model's forward, `change()` (if given) made after the second token (the first may compile: tracing registers
    parameters, which counts as a change), inside the one generate-like call: whether the step was usable at each
    token, and the largest difference of the logits."""
    used, off = [], 0.0
    step = compiled.compiled_step(model)
    with torch.inference_mode(), decoding_linears(model):
        fast, general = model.new_cache(1, 40), model.new_cache(1, 40)
        model(torch.tensor([PROMPT]), cache=fast)
        model(torch.tensor([PROMPT]), cache=general)
        token = torch.tensor([5])
        for i in range(count):
            if i == 2 and change is not None:
                change()
            used.append(step.usable(fast))
            got = compiled.next_logits(model, token, fast)
            want = model(token[:, None], cache=general)[:, -1]
            off = max(off, float((got - want).abs().max()))
            token = want.argmax(-1)
    return used, off


def test_a_weight_written_in_place_is_read_by_the_compiled_step(models):
    model = models["gpt"]
    weight = model.blocks[1].attn.o_proj.weight
    assert steps_against_general(model) == ([True] * 4, pytest.approx(0.0, abs=1e-5))  # traced
    with torch.no_grad():
        weight.mul_(-0.5)  # (exact, and undone exactly)
    try:
        used, off = steps_against_general(model)
    finally:
        with torch.no_grad():
            weight.div_(-0.5)
    assert used == [True] * 4 and off <= 1e-5  # the graph read the new values: not a copy of the old


def test_a_weight_set_anew_takes_the_general_step_until_it_is_back(models):
    """Set in the middle of a call (no layer swapped since: as in qkv serve's loop), found by torch's global
    registration hooks (qkv.nn.changes)."""
    model = models["gpt"]
    norm = model.blocks[1].ffn_norm
    old = norm.weight

    def set_anew():
        norm.weight = nn.Parameter(old.detach() * -0.5, requires_grad=False)

    try:
        used, off = steps_against_general(model, 5, change=set_anew)
    finally:
        norm.weight = old
    assert used == [True, True, False, False, False] and off <= 1e-5  # the graph holds the old weight
    assert steps_against_general(model) == ([True] * 4, pytest.approx(0.0, abs=1e-5))  # the held one is back


def test_a_quantized_layers_new_codes_take_the_general_step_until_enabled_again():
    """int4: the kernel's operands are a packed copy of the codes, which set_weight drops; a step still reading
    the old copy would give the old layer's logits. New codes in the middle of a call (no layer swapped since)."""
    model = tiny("int4", "fp32", **LLAMA)
    compiled.enable(model, summed=False)
    layer = model.blocks[0].attn.o_proj
    used, off = steps_against_general(model, 5, change=lambda: layer.set_weight(-layer.weight))
    assert used == [True, True, False, False, False] and off <= 1e-5
    compiled.enable(model, summed=False)  # graphs traced for the new codes
    used, off = steps_against_general(model)
    assert used == [True] * 4 and off <= 1e-5
