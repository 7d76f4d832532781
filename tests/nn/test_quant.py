"""qkv.nn.quant and qkv.generate.weights: the quantized products against the dequantized fp32 products (the
kernels), the dequantized weights against the originals within half a step (the quantizers), a GGUF Q4_1 file's
weights requantized to themselves, and a whole model at each precision against fp32."""
import pytest
import torch
from torch import nn

from qkv.errors import QkvError
from qkv.generate import weights
from qkv.nn.quant import (DENSE_PROMPT, QuantLinear, dequantize_int4, dequantize_int8, head_kind, head_of, int4_supported,
                          quantize_int4, quantize_int8)

torch.manual_seed(0)


def test_int8_codes_are_within_half_a_step_of_the_weights():
    w = torch.randn(48, 96) * torch.rand(48, 1) * 3  # rows of different scales
    codes, scale = quantize_int8(w)
    assert codes.dtype == torch.int8 and codes.abs().max() <= 127
    assert torch.all((dequantize_int8(codes, scale) - w).abs() <= scale[:, None] / 2 + 1e-6)
    assert torch.allclose(scale, w.abs().amax(1) / 127)


def test_int4_codes_are_within_half_a_step_and_keep_each_groups_range():
    w = torch.randn(40, 128) * 2 + 0.5
    codes, scale, low = quantize_int4(w, 32)
    assert codes.dtype == torch.uint8 and int(codes.max()) <= 15 and scale.shape == (40, 4)
    back = dequantize_int4(codes, scale, low)
    steps = scale.repeat_interleave(32, dim=1)
    assert torch.all((back - w).abs() <= steps / 2 + 1e-5)
    groups = w.reshape(40, 4, 32)
    assert torch.allclose(back.reshape(40, 4, 32).amin(2), groups.amin(2), atol=1e-5)  # the range is kept exactly
    assert torch.allclose(back.reshape(40, 4, 32).amax(2), groups.amax(2), atol=1e-5)


def test_a_constant_or_zero_row_quantizes_without_nan():
    w = torch.zeros(4, 64)
    w[1] = 0.25
    for kind in ("int8", "int4"):
        with torch.no_grad():
            layer = QuantLinear.from_linear(_linear(w), kind)
        assert torch.allclose(layer.weight, w, atol=1e-6)


def _linear(w: torch.Tensor, bias: bool = False) -> nn.Linear:
    layer = nn.Linear(w.shape[1], w.shape[0], bias=bias)
    with torch.no_grad():
        layer.weight.copy_(w)
        if bias:
            layer.bias.normal_()
    return layer


@pytest.mark.parametrize("kind", ["int8", "int4"])
@pytest.mark.parametrize("rows", [1, 3, 64])
def test_the_kernel_equals_the_dequantized_product_and_stays_within_the_quantization_bound(kind, rows):
    linear = _linear(torch.randn(96, 128), bias=True)
    layer = QuantLinear.from_linear(linear, kind)
    layer.compute_dtype = None  # products in x's dtype (fp32); bf16 products: the next test
    x = torch.randn(rows, 128)
    with torch.no_grad():
        y = layer(x)
        exact = x @ layer.weight.t() + linear.bias  # the dequantized matrix, in fp32
        original = linear(x)
    assert y.shape == (rows, 96) and y.dtype == torch.float32
    assert torch.allclose(y, exact, rtol=1e-4, atol=1e-4)
    # |x (W - W^)^T| <= sum_j |x_j| step_ij / 2, each weight within half its step
    step = (layer.scale[:, None].expand(96, 128) if kind == "int8" else layer.scale.repeat_interleave(32, dim=1))
    bound = x.abs() @ (step / 2).t()
    assert torch.all((y - original).abs() <= bound + 1e-4)


@pytest.mark.parametrize("kind", ["int8", "int4"])
@pytest.mark.parametrize("length", [5, DENSE_PROMPT])  # a long prompt's int8 products: (x q^T) s, dense kernel
def test_bf16_products_match_fp32_within_bf16_rounding(kind, length):
    layer = QuantLinear.from_linear(_linear(torch.randn(64, 256)), kind)
    x = torch.randn(2, length, 256)
    with torch.no_grad():
        layer.compute_dtype = None
        y16, y32 = layer(x.bfloat16()), layer(x)
        layer.compute_dtype = torch.bfloat16  # fp32 rows, bf16 products (the default where bf16 is native)
        mixed = layer(x)
    assert y16.dtype == torch.bfloat16 and y16.shape == (2, length, 64) and mixed.dtype == torch.float32
    scale = y32.abs().max()
    for y in (y16, mixed):
        assert (y.float() - y32).abs().max() <= 2 ** -7 * scale * 4  # a few bf16 ulps of the largest output


def test_int8_takes_torchs_kernel_for_decode_rows_and_short_prompts_and_the_dense_form_for_long_ones(monkeypatch):
    """bf16 rows: torch's int8 kernel for fewer than DENSE_PROMPT positions a row, however many rows (a decode
    step's batch; a flat input), (x q^T) s from DENSE_PROMPT on, however few rows (a prompt's products do not
    depend on the batch it came in); fp32 rows: the dense form always."""
    layer = QuantLinear.from_linear(_linear(torch.randn(64, 256)), "int8")
    layer.compute_dtype = None
    kernel, calls = torch._weight_int8pack_mm, []
    monkeypatch.setattr(torch, "_weight_int8pack_mm", lambda *a: calls.append(a[0].shape[0]) or kernel(*a))
    x = torch.randn(5, DENSE_PROMPT, 256)
    with torch.no_grad():
        layer(x[:, :1].bfloat16()), layer(x.flatten(0, 1).bfloat16()), layer(x[:, 1:].bfloat16())
        prompt = layer(x[:1].bfloat16())
        layer(x[:, :1]), layer(x)
    assert calls == [5, 5 * DENSE_PROMPT, 5 * (DENSE_PROMPT - 1)]
    exact = x[:1].bfloat16().float() @ layer.weight.t()
    assert (prompt.float() - exact).abs().max() <= 2 ** -7 * exact.abs().max()  # two bf16 roundings at most


@pytest.mark.parametrize("width", [20, 24, 56])
def test_an_int8_layer_of_a_width_torchs_kernel_cannot_take_uses_the_dense_form(monkeypatch, width):
    """torch's int8 kernel crashes the process on bf16 rows of a width not a multiple of 16 (an MoE expert's
    down projection: Qwen3-MoE-shaped 20): such a layer multiplies (x q^T) s instead, with the same products."""
    layer = QuantLinear.from_linear(_linear(torch.randn(32, width)), "int8")
    layer.compute_dtype = None
    monkeypatch.setattr(torch, "_weight_int8pack_mm", lambda *a: pytest.fail("torch's int8 kernel was called"))
    x = torch.randn(3, width).bfloat16()
    with torch.no_grad():
        y = layer(x)
    exact = x.float() @ layer.weight.t()
    assert (y.float() - exact).abs().max() <= 2 ** -7 * exact.abs().max() * 2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a GPU-only path: run on a machine with CUDA")
@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_on_a_gpu_the_layer_dequantizes_for_the_product_and_trains_through_it(kind):
    """torch's weight-only kernels for these layouts are CPU ones: on CUDA the layer multiplies by its
    dequantized W (the CPU kernel's product within the quantization's own rounding) and QLoRA's dL/dx flows."""
    linear = _linear(torch.randn(96, 128), bias=True)
    cpu = QuantLinear.from_linear(linear, kind)
    cpu.compute_dtype = None
    gpu = QuantLinear.from_linear(linear, kind).cuda()
    x = torch.randn(7, 128)
    with torch.no_grad():
        want = cpu(x)
    xg = x.cuda().requires_grad_()
    y = gpu(xg)
    assert y.device.type == "cuda" and y.dtype == torch.float32
    torch.testing.assert_close(y.cpu(), want, rtol=1e-4, atol=1e-4)
    y.square().sum().backward()
    torch.testing.assert_close(xg.grad.cpu(), (2 * want) @ cpu.weight, rtol=1e-4, atol=1e-3)


def test_products_are_bf16_where_the_machine_measured_bf16_rows_faster(monkeypatch):
    """The rows' precision follows qkv.nn.forms' kept choice (quant_rows_bf16), not the CPU's flags."""
    from qkv.nn import forms

    for faster, expected in ((True, torch.bfloat16), (False, None)):
        monkeypatch.setattr(forms, "choice", lambda name, measure=None: faster if name == "quant_rows_bf16" else None)
        assert QuantLinear.from_linear(_linear(torch.randn(8, 64)), "int8").compute_dtype == expected


def test_the_rows_measurement_times_both_precisions_of_the_same_products():
    """forms.measure_rows: int8 and int4 layers with bf16 and fp32 rows (checked equal to bf16's rounding before
    they are timed), the faster chosen."""
    from qkv.nn import forms

    result = forms.measure_rows(QuantLinear.from_linear, megabytes=1)
    assert result["bf16_rows_ms"] > 0 and result["fp32_rows_ms"] > 0
    assert result["choice"] is (result["bf16_rows_ms"] < result["fp32_rows_ms"])


def test_the_state_dict_round_trips_and_rebuilds_the_kernels_copy():
    a = QuantLinear.from_linear(_linear(torch.randn(32, 64)), "int4")
    b = QuantLinear.from_linear(_linear(torch.randn(32, 64)), "int4")
    x = torch.randn(3, 64)
    with torch.no_grad():
        b(x)  # b's kernel copy is made from its own codes
        b.load_state_dict(a.state_dict())
        assert torch.equal(a(x), b(x))
    assert set(a.state_dict()) == {"codes", "scale", "low"}


def test_q4_1_weights_requantize_to_themselves():
    """GGUF's Q4_1 (blocks of 32: a scale d and a minimum m, w = d q + m) quantized by the gguf package, then
    dequantized, then quantized by qkv: the same weights (nothing lost twice)."""
    gguf = pytest.importorskip("gguf")
    w = torch.randn(16, 128).numpy()
    blocks = gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q4_1)
    dequantized = torch.from_numpy(gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType.Q4_1)).float()
    layer = QuantLinear.from_linear(_linear(dequantized), "int4")
    assert torch.allclose(layer.weight, dequantized, rtol=0, atol=1e-6 * float(dequantized.abs().max()))


def test_int4_codes_are_held_two_a_byte():
    from qkv.nn.quant import pack_nibbles, unpack_nibbles

    codes = torch.randint(0, 16, (6, 64), dtype=torch.uint8)
    packed = pack_nibbles(codes)
    assert packed.shape == (6, 32) and torch.equal(unpack_nibbles(packed), codes)
    assert int(packed[0, 0]) == int(codes[0, 0]) + 16 * int(codes[0, 1])
    layer = QuantLinear.from_linear(_linear(torch.randn(16, 64)), "int4")
    assert layer.codes.shape == (16, 32) and layer.codes.dtype == torch.uint8


def test_int4_takes_whole_groups_and_outputs_in_sixteens_only():
    """What torch's packing accepts: whole groups of inputs, outputs in multiples of 16 (it refuses 8 and 6)."""
    assert int4_supported(torch.zeros(16, 64)) and not int4_supported(torch.zeros(16, 48))
    assert not int4_supported(torch.zeros(8, 64)) and not int4_supported(torch.zeros(6, 64))
    for rows in (16, 8):
        codes = torch.zeros(rows, 32, dtype=torch.int32)
        if int4_supported(torch.zeros(rows, 64)):
            torch._convert_weight_to_int4pack_for_cpu(codes, 1)
        else:
            with pytest.raises(RuntimeError):
                torch._convert_weight_to_int4pack_for_cpu(codes, 1)


# ------------------------------------------------------------------------------------------- whole models
def tiny_llama(tmp_path):
    from qkv.formats import load
    from tests.formats.gguf import write_llama

    return load(write_llama(tmp_path / "m.gguf", qtype="Q4_1", width=64, ffn=128, tied=True))


def kl(reference: torch.Tensor, other: torch.Tensor) -> float:
    p = reference.log_softmax(-1)
    return float((p.exp() * (p - other.float().log_softmax(-1))).sum(-1).mean())


@pytest.mark.parametrize("dtype, quant, max_kl", [("bf16", "none", 1e-3), ("fp32", "int8", 1e-3),
                                                  ("fp32", "int4", 1e-3), ("bf16", "int4", 2e-3)])
def test_a_model_at_each_precision_stays_close_to_fp32(tmp_path, dtype, quant, max_kl):
    run = tiny_llama(tmp_path)
    ids = torch.randint(0, 300, (2, 24))
    with torch.no_grad():
        reference = run.model(ids)
        description = weights.prepare(run.model, dtype=dtype, quant=quant)
        logits = run.model(ids)
    assert logits.dtype == weights.DTYPES[dtype]
    assert kl(reference, logits) < max_kl, description
    if quant == "int4":  # a Q4_1 file's own weights: every int4 layer holds exactly what was loaded
        assert "groups of 32" in description
    if quant != "none":  # the head above 4 bits: bf16 where the CPU has it natively, else int8
        assert f"the head {head_kind()}" in description
        assert head_of(run.model) == head_kind()


@pytest.mark.parametrize("dtype, quant", [("fp32", "int8"), ("bf16", "int8"), ("fp32", "int4")])
def test_an_moe_keeps_its_routers_exact_at_each_precision(dtype, quant):
    """A Qwen3-MoE-shaped model (experts 20 wide: widths torch's int8 and int4 kernels cannot take in every form):
    the routers stay nn.Linear, unquantized (their scores choose the experts), the experts are quantized, and the
    logits stay close to fp32's."""
    from qkv.config import ModelConfig
    from qkv.models import build_model

    torch.manual_seed(0)
    model = build_model(ModelConfig(vocab_size=300, d_model=64, n_heads=4, n_layers=2, d_ff=96, ffn="glu",
                                    activation="silu", norm="rmsnorm", positional="rope", bias=False,
                                    moe_experts=6, moe_top_k=2, moe_d_ff=20)).eval()
    ids = torch.randint(0, 300, (2, 24))
    with torch.no_grad():
        reference = model(ids)
        weights.prepare(model, dtype=dtype, quant=quant)
        logits = model(ids)
    routers = [m for name, m in model.named_modules() if name.endswith("router")]
    assert len(routers) == 2 and all(type(m) is nn.Linear for m in routers)
    assert isinstance(model.blocks[0].ffn.experts[0].up_proj, QuantLinear)
    assert kl(reference, logits) < 5e-3


@pytest.mark.parametrize("flag, head", [("avx512_bf16", "bf16"), (None, "int8")])
def test_the_head_is_bf16_where_native_else_int8(monkeypatch, tmp_path, flag, head):
    from qkv import hardware

    monkeypatch.setattr(hardware, "native_bf16_cpu", lambda: flag)
    run = tiny_llama(tmp_path)
    ids = torch.randint(0, 300, (1, 16))
    with torch.no_grad():
        reference = run.model(ids)
        weights.prepare(run.model, quant="int4")
        logits = run.model(ids)
    assert head_of(run.model) == head and kl(reference, logits) < 1e-3


def test_int4_of_a_q4_1_file_is_the_file_itself(tmp_path):
    run = tiny_llama(tmp_path)
    loaded = {name: module.weight.detach().clone() for name, module in run.model.named_modules()
              if type(module) is nn.Linear and name != "lm_head"}
    weights.prepare(run.model, quant="int4")
    for name, module in run.model.named_modules():
        if name in loaded:
            assert module.kind == "int4"
            assert torch.allclose(module.weight, loaded[name], rtol=0, atol=1e-6), name


def test_generation_runs_with_the_kv_cache_at_each_precision(tmp_path):
    from qkv.generate import generate

    prompt = torch.randint(0, 300, (1, 5))
    for dtype, quant in (("bf16", "none"), ("fp32", "int8"), ("bf16", "int4")):
        model = tiny_llama(tmp_path).model
        weights.prepare(model, dtype=dtype, quant=quant)
        with torch.no_grad():
            cached = generate(model, prompt, max_new_tokens=6, strategy="greedy")
            # the same tokens from full forwards without the cache: greedy argmax at each length
            ids = prompt
            for _ in range(6):
                ids = torch.cat((ids, model(ids)[:, -1].argmax(-1, keepdim=True)), dim=1)
        assert torch.equal(cached, ids), (dtype, quant)


def test_bad_precisions_are_refused_and_emulated_bf16_is_warned(monkeypatch):
    with pytest.raises(QkvError, match="--dtype"):
        weights.check("fp16", "none", torch.device("cpu"))
    with pytest.raises(QkvError, match="--quant"):
        weights.check("fp32", "int3", torch.device("cpu"))
    with pytest.raises(QkvError, match="CPU kernels"):
        weights.check("fp32", "int8", torch.device("cuda"))
    from qkv import hardware

    monkeypatch.setattr(hardware, "native_bf16_cpu", lambda: None)
    assert "emulates" in weights.check("bf16", "none", torch.device("cpu"))[0]
    monkeypatch.setattr(hardware, "native_bf16_cpu", lambda: "avx512_bf16")
    assert weights.check("bf16", "int4", torch.device("cpu")) == []
    # bf16 weights without AMX: one-row products no faster than fp32 (measured), so decoding is slower, unless
    # the compiled step's sums take them (where this machine measured them the faster: qkv.nn.forms)
    assert "no AMX" in weights.check("bf16", "none", torch.device("cpu"))[0]
    monkeypatch.setattr(weights, "summed_form_known", lambda dtype: True)
    assert weights.check("bf16", "none", torch.device("cpu"), compiled=True) == []
    assert "the compiled step (without --no-compile) is faster" in weights.check("bf16", "none", torch.device("cpu"))[0]
    monkeypatch.setattr(weights, "summed_form_known", lambda dtype: False)
    assert "no AMX" in weights.check("bf16", "none", torch.device("cpu"), compiled=True)[0]
    monkeypatch.setattr(hardware, "native_bf16_cpu", lambda: "amx_bf16")
    assert weights.check("bf16", "none", torch.device("cpu")) == []
    assert weights.check("fp32", "none", torch.device("cpu")) == []


@pytest.mark.parametrize("kind", ["int8", "int8g"])
def test_a_dense_product_is_taken_in_the_measured_precision(kind):
    """A prompt's dense form (int8: (x q^T) s; int8g: W dequantized) in fp32 where dense_dtype says so (bf16 not
    native: forms.measure_dense): the rows in the kernels' precision (compute_dtype, bf16 here, as a decode
    step's), multiplied in fp32 within its rounding, returned in x's dtype; with dense_dtype None, in bf16."""
    w = torch.randn(48, 256)
    if kind == "int8":
        layer = QuantLinear.from_linear(_linear(w), "int8")
    else:
        codes, scale = torch.randint(-127, 128, (48, 256), dtype=torch.int8), torch.rand(48, 8) / 64
        layer = QuantLinear.from_codes(codes, scale, None, None)
    x = torch.randn(2, DENSE_PROMPT, 256)
    w = layer.weight if kind == "int8g" else dequantize_int8(layer.codes, layer.scale.bfloat16().float())
    want = x.bfloat16().float() @ w.t()  # the rows (and int8's row scales, the kernel's) rounded to bf16
    layer.compute_dtype, layer.dense_dtype = torch.bfloat16, torch.float32
    with torch.no_grad():
        fp32, rows16 = layer(x), layer(x.bfloat16())
        layer.dense_dtype = None
        bf16 = layer(x)
    assert fp32.dtype == torch.float32 and rows16.dtype == torch.bfloat16
    assert (fp32 - want).abs().max() <= 1e-5 * want.abs().max()
    assert torch.equal(rows16, fp32.bfloat16())
    assert (bf16 - want).abs().max() > 10 * (fp32 - want).abs().max()  # bf16's product rounds (int8: its scales)
