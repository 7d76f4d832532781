"""qkv.nn.decoding_linear: the decoding step's linear layer equals nn.Linear for any number of rows."""
import pytest
import torch

from qkv.nn.decoding_linear import DecodingLinear


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
    from qkv.nn import quant

    monkeypatch.setattr(quant, "left_form_faster", lambda dtype: left)
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


@pytest.mark.parametrize("vendor, mkl, fp32_left, bf16_left", [
    ("GenuineIntel", True, False, True),  # MKL's one-row x W^T is the fast fp32 form there; oneDNN's bf16 is not
    ("AuthenticAMD", True, True, False),  # the measured AMD machines: the reverse
    ("GenuineIntel", False, True, True),  # no MKL: fp32 keeps the form measured first
    (None, False, True, False),  # a CPU that does not say (Arm)
])
def test_the_decode_form_follows_the_cpu_and_the_dtype(monkeypatch, vendor, mkl, fp32_left, bf16_left):
    from qkv import hardware
    from qkv.nn import decoding_linear

    monkeypatch.setattr(hardware, "cpu_vendor", lambda: vendor)
    monkeypatch.setattr(torch.backends.mkl, "is_available", lambda: mkl)
    choose = decoding_linear.left_form_faster.__wrapped__  # the rule itself, not this machine's cached answer
    assert choose(torch.float32) is fp32_left and choose(torch.bfloat16) is bf16_left
    assert choose(torch.float16) is False and choose(torch.float64) is False
