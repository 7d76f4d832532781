"""qkv.nn.decoding_linear: the decoding step's linear layer equals nn.Linear for any number of rows."""
import shutil

import pytest
import torch

from qkv.nn.decoding_linear import DecodingLinear
from qkv.nn.quant import quantize_int8


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(1, 1), (3, 1), (2, 4), (0, 1), (3, 50)])  # 150 rows > max_rows
def test_decoding_linear_equals_nn_linear(bias, shape):
    torch.manual_seed(0)
    layer = torch.nn.Linear(16, 40, bias=bias)
    x = torch.randn(*shape, 16)
    out = DecodingLinear(layer)(x)
    torch.testing.assert_close(out, layer(x), rtol=1e-6, atol=1e-6)
    assert out.is_contiguous()


@pytest.mark.parametrize("left", [False, True])
@pytest.mark.parametrize("rows", [1, 3, 70])  # 70 > max_rows: nn.Linear's form whatever the CPU
def test_the_bf16_head_equals_its_bf16_product_in_either_form(monkeypatch, left, rows):
    """qkv.nn.quant.Bf16Linear (a quantized model's head) takes W x^T for a decode step's rows where that form is
    the faster (bf16 on Intel): the same bf16 product as F.linear's, to bf16 rounding of the sums' order."""
    from qkv.nn import bf16_linear, quant

    monkeypatch.setattr(bf16_linear, "left_form_faster", lambda dtype: left)
    torch.manual_seed(0)
    layer = torch.nn.Linear(64, 40)
    head = quant.Bf16Linear(layer.weight, layer.bias)
    x = torch.randn(rows, 1, 64)
    expected = torch.nn.functional.linear(x.bfloat16(), layer.weight.bfloat16(), layer.bias.bfloat16()).float()
    with torch.no_grad():
        out = head(x)
    assert out.dtype == torch.float32 and out.shape == (rows, 1, 40)
    torch.testing.assert_close(out, expected, rtol=2 ** -7, atol=2e-2)  # bf16: 8 significant bits
    with torch.no_grad():
        exact = torch.nn.functional.linear(x.bfloat16().double(), layer.weight.bfloat16().double(),
                                           layer.bias.bfloat16().double())
    assert (out.double() - exact).abs().max() < 0.05  # the true product of the bf16 operands, either form


needs_compiler = pytest.mark.skipif(shutil.which("c++") is None and shutil.which("g++") is None,
                                    reason="torch.compile on the CPU needs a C++ compiler; none on PATH")

SUMMED_CASES = {  # W's kind: (x's dtype, how W is held, the tolerance of y against the float64 product)
    "fp32": (torch.float32, lambda w: (w, None), dict(rtol=1e-5, atol=1e-5)),
    "bf16": (torch.bfloat16, lambda w: (w.bfloat16(), None), dict(rtol=2 ** -8, atol=1e-3)),  # y rounded once
    "int8": (torch.bfloat16, lambda w: quantize_int8(w), dict(rtol=2 ** -8, atol=1e-3)),
}


@needs_compiler
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("kind", list(SUMMED_CASES))
def test_the_summed_product_in_a_compiled_graph_is_the_product(kind, bias):
    """summed_product (qkv.nn.decoding_linear) as inductor generates it: y_i = s_i sum_j W_ij x_j + b_i for
    the operands as held (x and W rounded to their dtype), summed in fp32 and rounded once to x's dtype, against
    the same sum in float64; eagerly the same values."""
    from qkv.nn.decoding_linear import summed_product, summing

    dtype, hold, tolerance = SUMMED_CASES[kind]
    torch.manual_seed(0)
    w, scale = hold(torch.randn(96, 200) * 0.1)
    b = torch.randn(96).to(dtype) if bias else None
    x = torch.randn(1, 1, 200).to(dtype)
    exact = (w.double() * x.reshape(1, 200).double()).sum(-1)
    exact = (exact * (1 if scale is None else scale.to(dtype).double())) + (0 if b is None else b.double())
    with torch.inference_mode(), summing(True):  # (as the compiled step calls it: the row stored first)
        fused = torch.compile(lambda x: summed_product(x, w, b, None if scale is None else scale.to(dtype)),
                              options={"emulate_precision_casts": True})(x)
        eager = summed_product(x, w, b, None if scale is None else scale.to(dtype))
    assert fused.shape == (1, 1, 96) and fused.dtype == dtype
    torch.testing.assert_close(fused.double().flatten(), exact, **tolerance)
    torch.testing.assert_close(fused, eager, rtol=1e-5 if dtype == torch.float32 else 2 ** -7, atol=1e-5)


@needs_compiler
def test_layers_take_the_summed_form_only_when_compiled_inside_summing(monkeypatch):
    """One row's product takes the summed form inside a traced graph under summing(True), and torch's
    kernel otherwise: eagerly, under summing(False), and for two rows but with fp32 weights (a short prompt's
    rows: up to SUMMED_ROWS), whose 17 take the kernel."""
    from qkv.nn import bf16_linear, decoding_linear, quant

    calls = []

    def counted(*args, **kwargs):
        calls.append(args[1].dtype)
        return summed_product(*args, **kwargs)

    summed_product = decoding_linear.summed_product
    monkeypatch.setattr(decoding_linear, "summed_product", counted)
    monkeypatch.setattr(quant, "summed_product", counted)
    monkeypatch.setattr(bf16_linear, "summed_product", counted)
    torch.manual_seed(0)
    linear = torch.nn.Linear(32, 48)
    layers = [DecodingLinear(linear), quant.QuantLinear.from_linear(linear, "int8"),
              quant.Bf16Linear(linear.weight, linear.bias), quant.QuantLinear.from_linear(linear, "int4")]
    for rows, on, compiling, expected in [(1, True, True, [torch.float32, torch.int8, torch.bfloat16]),
                                          (1, True, False, []), (1, False, True, []),
                                          (1, frozenset({torch.int8}), True, [torch.int8]),  # by dtype (forms)
                                          (2, True, True, [torch.float32]), (17, True, True, [])]:
        calls.clear()
        for layer in layers:
            x = torch.randn(rows, 32)
            with torch.inference_mode(), decoding_linear.summing(on):
                step = torch.compile(layer, dynamic=False, options={"emulate_precision_casts": True})  # as the step
                out = step(x) if compiling else layer(x)
            with torch.inference_mode():
                eager = layer(x)  # torch's kernel for the layer's product
            # (int8 and the bf16 head: bf16 rows and results, rounded as the kernel rounds them, sums in fp32)
            torch.testing.assert_close(out, eager, rtol=2 ** -7, atol=1e-4,
                                       msg=lambda m: f"{type(layer).__name__}, {rows} rows, summing {on}: {m}")
            torch._dynamo.reset()
        assert calls == expected, (rows, on, compiling)  # (int4: grouped.c's loops or torch's kernel, never summed)


def test_the_row_is_stored_by_inductors_prim_once_summing_is_on():
    """`stored` hands the row to inductor's force_stride_order prim (a copy inductor must write to memory: else it
    recomputes what made the row inside the sum's loop); summing(True) registers that prim before any trace."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from qkv.nn.decoding_linear import stored, summing

    with summing(True):
        graph = make_fx(stored)(torch.randn(1, 8)).graph
    targets = [str(node.target) for node in graph.nodes if node.op == "call_function"]
    assert any("inductor_force_stride_order" in target for target in targets), targets
