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
