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
