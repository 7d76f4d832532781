"""The compiled decoding step (qkv.generate.compiled) against the general one: the same logits step by step,
the same greedy text through generate (through the CLI: test_compiled_cli.py), the general path wherever the
compiled one does not apply.

Each model compiles once (a few seconds; about 17 s for the first compile of a process with an empty cache);
inductor's cache goes to the test run's temporary directory (tests/conftest.py), not the user's."""
import shutil

import pytest
import torch

import qkv
from qkv.errors import QkvError
from qkv.generate import compiled, generate
from qkv.generate.weights import prepare
from qkv.nn.decoding_linear import decoding_linears
from qkv.nn.quant import QuantLinear

NEEDS_CXX = pytest.mark.skipif(shutil.which("c++") is None and shutil.which("g++") is None,
                               reason="torch.compile on the CPU needs a C++ compiler; none on PATH")
pytestmark = [NEEDS_CXX, pytest.mark.usefixtures("own_inductor_cache")]  # (tests/generate/conftest.py)

LLAMA = dict(positional="rope", norm="rmsnorm", ffn="glu", activation="silu", bias=False, n_kv_heads=2,
             qk_norm=True)  # GQA, QK-norm, SwiGLU, no biases
GPT = dict(positional="learned", norm="layernorm", ffn="mlp", activation="gelu_tanh", bias=True)
GEMMA = dict(LLAMA, activation="gelu_tanh", norm_placement="sandwich", embed_scale=True, head_size=24, query_scale=20.0,
             attn_softcap=3.0, logit_softcap=5.0, n_layers=4, layer_types=("sliding", "global", "nope", "sliding"),
             sliding_window=4, rope_local_theta=100.0)  # qkv.plan: every kind of layer, Gemma's model-wide facts
PROMPT = [3, 14, 15, 9, 2, 6]


def tiny(quant: str = "none", dtype: str = "fp32", **overrides) -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = qkv.ModelConfig(**{**dict(vocab_size=64, d_model=64, n_heads=4, n_layers=2, d_ff=128, max_seq_len=40,
                                    init_std=0.3), **overrides})
    model = qkv.build_model(cfg).eval()
    prepare(model, dtype=dtype, quant=quant)  # fused Q/K/V and gate/up, as a loaded model decodes
    return model


# name: (quant, dtype, family, one row's products as summed_product's sums or torch's kernels): both forms on
# every machine, whichever this CPU would choose (qkv.nn.forms, by dtype)
MODELS = {"llama-int4": ("int4", "fp32", LLAMA, False), "gpt": ("none", "fp32", GPT, True),
          "llama-int8": ("int8", "fp32", LLAMA, True), "llama-bf16": ("none", "bf16", LLAMA, True),
          "gemma": ("none", "fp32", GEMMA, False)}  # (torch's kernels: its batch graph compiles in 46 s, not 61)


def fp32_close(model: torch.nn.Module, got: torch.Tensor, want: torch.Tensor) -> None:
    """The compiled step's fp32 logits against the general step's: fp32's rounding. Where a layer rounds its
    rows to bf16 (torch's int8 kernel under the int4 model's int8 head, qkv.nn.quant.quant_rows), the fp32
    rounding of its input may move a sum by one bf16 step: that much at the largest logit."""
    rounds = any(isinstance(m, QuantLinear) and m.compute_dtype == torch.bfloat16 and not m.native
                 for m in model.modules())
    torch.testing.assert_close(got, want, rtol=1e-5, atol=2 ** -7 * float(want.abs().max()) if rounds else 1e-5)


def compiled_models() -> dict[str, torch.nn.Module]:
    """MODELS, each with its compiled step enabled: LLaMA-shaped models with int4 weights (torch's kernels), int8
    weights and bf16 ones (summed products), a GPT-2-shaped one in fp32 (summed products). The `models` fixture
    (tests/generate/conftest.py: once a session, so that each graph compiles once for both test files)."""
    out = {}
    for name, (quant, dtype, family, summed) in MODELS.items():
        out[name] = tiny(quant, dtype, **family)
        compiled.enable(out[name], summed=summed)
    return out


@pytest.mark.parametrize("name", list(MODELS))
def test_compiled_step_gives_the_general_steps_logits(models, name):
    """fp32 activations: the general step's logits and cache to fp32's rounding. bf16 (the model in bf16): the
    compiled step rounds less (its attention sums in fp32 where torch's bf16 kernel rounds inside), so both are
    held to the exact math of the same bf16 weights (the model in float64): the compiled step no further from it
    than the general one."""
    model = models[name]
    step = compiled.compiled_step(model)
    bf16 = MODELS[name][1] == "bf16"
    exact = float64_twin(name) if bf16 else None
    # (as generate decodes: its cache inference tensors, its layers DecodingLinear, whose one row is summed)
    with torch.inference_mode(), decoding_linears(model):
        # (rings for sliding layers, as generate, chat and serve make them: the graph generate takes below; a
        # sliding layer without a ring: test_compiled_prompt's short prompt and its steps)
        general, fast = model.new_cache(1, 40, rings=True), model.new_cache(1, 40, rings=True)
        model(torch.tensor([PROMPT]), cache=general)
        model(torch.tensor([PROMPT]), cache=fast)
        if bf16:
            reference = exact.new_cache(1, 40)
            exact(torch.tensor([PROMPT]), cache=reference)
        token = torch.tensor([5])
        for _ in range(12):
            assert step.usable(fast)
            want = model(token[:, None], cache=general)[:, -1]  # (1, V)
            got = step(token, fast)
            if bf16:
                truth = exact(token[:, None], cache=reference)[:, -1]
                off, general_off = (got.double() - truth).abs().max(), (want.double() - truth).abs().max()
                ulp = 2 ** -7 * truth.abs().max()  # about one bf16 rounding step at the largest logit
                assert off <= 2 * general_off + ulp, (off, general_off)  # of the general step's own order
            else:
                fp32_close(model, got, want)  # the same math, fused: fp32 rounding
            token = want.argmax(-1)
    assert step.failed is None
    assert fast.length == general.length == len(PROMPT) + 12
    n = general.length
    for i, (a, b) in enumerate(zip(general.layers, fast.layers)):
        for kind in ("k", "v"):
            want, got = getattr(a, kind)[:, :, :n], getattr(b, kind)[:, :, :n]
            if bf16:  # (the logits' bound, against the exact model's cache)
                truth = getattr(reference.layers[i], kind)[:, :, :n]
                off, general_off = (got.double() - truth).abs().max(), (want.double() - truth).abs().max()
                assert off <= 2 * general_off + 2 ** -7 * truth.abs().max(), (i, kind, off, general_off)
            else:
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def float64_twin(name: str) -> torch.nn.Module:
    """MODELS[name]'s model (a float dtype, no quant) with its weights rounded to that dtype, then held in
    float64 and not fused: the exact math of the same weights."""
    _, dtype, family, _ = MODELS[name]
    torch.manual_seed(0)
    cfg = qkv.ModelConfig(vocab_size=64, d_model=64, n_heads=4, n_layers=2, d_ff=128, max_seq_len=40,
                          init_std=0.3, **family)
    model = qkv.build_model(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(getattr(torch, {"bf16": "bfloat16"}.get(dtype, "float32"))).to(p.dtype))
    return model.double()


@pytest.mark.parametrize("name", ["llama-int4", "gpt"])  # (gemma: test_compiled_prompt's ring test)
def test_generate_with_the_compiled_step_gives_the_same_tokens(models, name):
    model = models[name]
    step = compiled.compiled_step(model)
    with_step = generate(model, torch.tensor([PROMPT]), max_new_tokens=30)
    step.failed = "off for the comparison"  # (usable() is False: the general step)
    try:
        without = generate(model, torch.tensor([PROMPT]), max_new_tokens=30)
    finally:
        step.failed = None
    assert with_step.tolist() == without.tolist()


@pytest.mark.parametrize("name", ["llama-int4", "gpt", "gemma"])
def test_compiled_step_on_a_left_padded_batch(models, name):
    """Rows of different lengths, left-padded (as generate pads prompts and qkv serve gathers its rows): each
    row's positions are its own and no query sees a padding column; the logits equal the general step's."""
    model = models[name]
    step = compiled.compiled_step(model)
    ids = torch.tensor([[0, 0, 0, 3, 4], [5, 6, 7, 8, 9], [0, 11, 12, 13, 14]])
    mask = (torch.arange(5) >= torch.tensor([[3], [0], [1]])).long()
    with torch.inference_mode(), decoding_linears(model):  # (as generate and qkv serve decode, sliding layers in rings)
        general, fast = model.new_cache(3, 40, rings=True), model.new_cache(3, 40, rings=True)
        model(ids, attention_mask=mask, cache=general)
        model(ids, attention_mask=mask, cache=fast)
        token = torch.tensor([5, 1, 2])
        for _ in range(8):
            assert fast.padded and step.usable(fast)
            want = model(token[:, None], cache=general)[:, -1]  # (3, V)
            got = step(token, fast)
            fp32_close(model, got, want)
            token = want.argmax(-1)
    assert step.failed is None
    torch.testing.assert_close(fast.positions[:, :13], general.positions[:, :13], rtol=0, atol=0)
    assert fast.padding[:, :13].tolist() == general.padding[:, :13].tolist()
    rows = generate(model, ids, attention_mask=mask, max_new_tokens=6)
    alone = generate(model, torch.tensor([[3, 4]]), max_new_tokens=6)
    assert rows[0, 3:].tolist() == alone[0].tolist()  # the padded row decodes as it does alone


def test_hooks_take_the_general_path(models):
    model = models["gpt"]
    step = compiled.compiled_step(model)

    def usable() -> bool:
        with torch.inference_mode():  # (as generate decodes: outside autograd)
            return step.usable(model.new_cache(1, 40))

    assert usable()  # seen without hooks (HookWatch keeps that until a hook is made)
    seen = []
    handle = model.blocks[0].register_forward_hook(lambda module, args, out: seen.append(out.shape[1]))
    try:
        assert not usable()  # a hook must see its layer run
        generate(model, torch.tensor([PROMPT]), max_new_tokens=5)
    finally:
        handle.remove()
    assert seen == [len(PROMPT), 1, 1, 1, 1]  # the prompt, then every step through the block
    assert usable()  # removed: the compiled step again
    handle = model.blocks[1].ffn.register_forward_pre_hook(lambda module, args: None)  # deep inside, a pre-hook
    try:
        assert not usable()
    finally:
        handle.remove()
    assert usable()
    layer = model.blocks[0].attn.o_proj  # a layer decoding_linears takes out for the duration, then puts back
    handle = None
    try:
        with decoding_linears(model):
            assert model.blocks[0].attn.o_proj is not layer
            handle = layer.register_forward_hook(lambda module, args, out: None)  # made while it is out
            assert usable()  # the hooked layer is not in the model now
        assert not usable()  # and is again: no hook was made since, but a layer came back
    finally:
        if handle is not None:
            handle.remove()


def test_a_failing_compiler_falls_back_with_one_warning(models, capsys):
    model = models["gpt"]
    want = generate(model, torch.tensor([PROMPT]), max_new_tokens=8)
    step = compiled.compiled_step(model)
    working = step.compiled

    def broken(*args):
        raise RuntimeError("no C++ compiler\nmore lines")

    step.compiled = broken
    try:
        got = generate(model, torch.tensor([PROMPT]), max_new_tokens=8)
        assert got.tolist() == want.tolist()
        err = capsys.readouterr().err
        assert err.count("qkv: warning: torch.compile failed (RuntimeError: no C++ compiler)") == 1
        assert step.failed is not None and not step.usable(model.new_cache(1, 40))
    finally:
        step.compiled, step.failed = working, None


@pytest.mark.parametrize("overrides, reason", [
    (dict(positional="alibi"), "ALiBi encoding"),
    (dict(attention="local", window=4, positional="rope"), "local attention kernel"),
    (dict(bigram_vocab=32, positional="rope"), "bigram"),
    (dict(positional="rope", rope_scaling="longrope", rope_original_context=8, rope_long_factors=(2.0,) * 8,
          rope_short_factors=(1.0,) * 8), "longrope"),  # (its frequencies change with a step's position)
])
def test_what_it_does_not_cover_is_refused_with_the_reason(overrides, reason):
    with pytest.raises(ValueError, match=reason):
        compiled.enable(tiny(**overrides))


def test_the_step_never_reaches_past_a_learned_table(models):
    """A learned table has rows for max_seq_len (40) positions; a longer cache stops the compiled step at its end,
    and the general step then refuses the position with its own error."""
    model = models["gpt"]
    step = compiled.compiled_step(model)
    with torch.inference_mode():
        cache = model.new_cache(1, 60)
        model(torch.arange(39)[None] % 64, cache=cache)
        assert step.usable(cache)  # position 39: the table's last row
        step(torch.tensor([1]), cache)
        assert cache.length == 40 and not step.usable(cache)
        with pytest.raises(QkvError, match="beyond the learned table"):
            compiled.next_logits(model, torch.tensor([1]), cache)
    # (stepped outside decoding_linears, whose layers its graph was traced with: swapped in for the call)
    assert step.failed is None


def test_every_quantized_products_operands_are_fixed_for_the_compiler(models):
    """The fused Q/K/V and gate/up layers are held outside the module tree (a plain attribute); their kernels'
    operands must be found too, or the compiler takes their sizes for variables (compiled.py)."""
    model = models["llama-int4"]
    with torch.inference_mode():
        cache = model.new_cache(1, 8)
        model(torch.tensor([PROMPT[:3]]), cache=cache)
        compiled.compiled_step(model)(torch.tensor([PROMPT[3]]), cache)
    layers = [layer for block in model.blocks
              for layer in (block.attn.fused_qkv, block.attn.o_proj, block.ffn.fused_gate_up, block.ffn.down_proj)]
    layers += [model.lm_head] if isinstance(model.lm_head, QuantLinear) else []
    assert all(isinstance(layer, QuantLinear) for layer in layers)
    expected = {id(t) for layer in layers for operands in layer.kernel_cache().values() for t in operands}
    found = compiled.kernel_operands(model)
    assert len(expected) == 2 * len(layers)  # codes and scales, one activation dtype
    assert {id(t) for t in found} == expected and len(found) == len(expected)


def test_a_model_changed_after_enable_takes_the_general_step(models):
    """The compiled graph does not check the model's weights every token (its guards on them are skipped): a
    model cast to another dtype after enable(), or in training mode, is refused by usable() instead."""
    from qkv.generate.weights import prepare as prepare_again

    model = tiny(**GPT)
    step = compiled.enable(model, summed=True)
    with torch.inference_mode():
        cache = model.new_cache(1, 40)
        model(torch.tensor([PROMPT]), cache=cache)
        assert step.usable(cache)
        model.train()
        assert not step.usable(cache)
        model.eval()
        prepare_again(model, dtype="bf16")
        assert not step.usable(cache)
    want = generate(model, torch.tensor([PROMPT]), max_new_tokens=4)  # the general step, in bf16
    step.failed = "off"
    assert generate(model, torch.tensor([PROMPT]), max_new_tokens=4).tolist() == want.tolist()


def test_two_models_of_one_shape_each_run_their_own_graph():
    """Each step compiles a code object of its own (compiled.own_code): the graph of one model is never run for
    another of the same shape (here one with fused projections and one without, the same weights), although the
    guards on the models are skipped."""
    fused, plain = tiny(**GPT), tiny(**GPT)
    for module in plain.modules():
        module.__dict__.pop("fused_qkv", None)
    for model in (fused, plain):
        step = compiled.enable(model, summed=True)
        with torch.inference_mode():
            cache, general = model.new_cache(1, 40), model.new_cache(1, 40)
            model(torch.tensor([PROMPT]), cache=cache)
            model(torch.tensor([PROMPT]), cache=general)
            got = step(torch.tensor([5]), cache)
            want = model(torch.tensor([[5]]), cache=general)[:, -1]
        assert step.failed is None
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_one_row_has_two_symbols_and_no_size_recompiles(monkeypatch):
    """One row's graph varies in the cache's columns (every layer's K and V: one symbol) and n only; a batch's
    rows are a symbol apart from its columns. Neither graph is traced again for other lengths or rows."""
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    made = []  # (where, symbol) of every size the tracer made a symbol of
    create = ShapeEnv.create_symbol

    def recorded(env, value, source, *args, **kwargs):
        made.append((source.name, create(env, value, source, *args, **kwargs)))
        return made[-1][1]

    monkeypatch.setattr(ShapeEnv, "create_symbol", recorded)
    model = tiny(**GPT)
    step = compiled.enable(model, summed=True)
    one = torch.tensor([PROMPT[:1]])  # (a prompt of one token: the model's forward, then the steps)
    generate(model, one, max_new_tokens=5)
    symbols = {str(s): where for where, s in made if not str(s).isdigit()}
    assert len(symbols) == 2 and "L['n']" in symbols.values(), symbols  # n, and the columns of all 4 tensors
    traced = len(made)
    generate(model, one, max_new_tokens=11)
    assert len(made) == traced  # other lengths: the same graph
    generate(model, one.repeat(2, 1), max_new_tokens=3)  # 2 rows, 1 + 3 - 1 columns
    rows = {str(s) for where, s in made[traced:] if where == "L['tokens'].size()[0]"}
    columns = {str(s) for where, s in made[traced:] if where == "L['keys'][0].size()[2]"}
    assert len(rows) == len(columns) == 1 and rows != columns and not rows.pop().isdigit()
    traced = len(made)
    generate(model, one.repeat(5, 1), max_new_tokens=4)
    assert len(made) == traced and step.failed is None  # 5 rows, 1 + 4 - 1 columns: the batch's graph
