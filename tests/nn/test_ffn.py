import math

import pytest
import torch

from qkv.nn.ffn import ACTIVATIONS, FFNS, GLU, MLP

# closed forms written out here, independent of torch.nn.functional
CLOSED_FORMS = {
    "relu": lambda x: torch.where(x > 0, x, torch.zeros_like(x)),
    "gelu": lambda x: 0.5 * x * (1 + torch.erf(x / math.sqrt(2))),  # x * Phi(x)
    "gelu_tanh": lambda x: 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3))),
    "silu": lambda x: x / (1 + torch.exp(-x)),  # x * sigmoid(x)
    "leaky_relu": lambda x: torch.where(x > 0, x, 0.01 * x),
    "relu6": lambda x: torch.clamp(torch.where(x > 0, x, torch.zeros_like(x)), max=6.0),
    "relu2": lambda x: torch.where(x > 0, x * x, torch.zeros_like(x)),
}


def test_every_activation_has_a_closed_form_here():
    assert set(ACTIVATIONS.names()) == set(CLOSED_FORMS), "add the new activation's closed form to CLOSED_FORMS"


@pytest.mark.parametrize("name", sorted(CLOSED_FORMS))
def test_activation_matches_its_closed_form(name):
    x = torch.linspace(-8, 8, 401, dtype=torch.float64)
    torch.testing.assert_close(ACTIVATIONS.get(name)(x), CLOSED_FORMS[name](x), rtol=1e-10, atol=1e-12)


def test_silu_derivative_is_sigma_times_one_plus_x_one_minus_sigma():
    """SPEC claim 28: sigmoid' = s(1 - s), so silu'(x) = s + x s (1 - s)."""
    x = torch.linspace(-6, 6, 101, dtype=torch.float64, requires_grad=True)
    (grad,) = torch.autograd.grad(ACTIVATIONS.get("silu")(x).sum(), x)
    s = torch.sigmoid(x.detach())
    torch.testing.assert_close(grad, s + x.detach() * s * (1 - s), rtol=1e-12, atol=1e-12)


def randomise(module):
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn_like(p))
    return module.double()


def linear(x, layer):
    return x @ layer.weight.T + (0 if layer.bias is None else layer.bias)


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("activation", sorted(CLOSED_FORMS))
def test_mlp_equals_act_x_w1_plus_b1_w2_plus_b2(activation, bias):
    ffn = randomise(MLP(6, 10, activation=activation, bias=bias))
    x = torch.randn(2, 3, 6, dtype=torch.float64)
    expected = linear(CLOSED_FORMS[activation](linear(x, ffn.up_proj)), ffn.down_proj)
    torch.testing.assert_close(ffn(x), expected, rtol=1e-10, atol=1e-10)
    assert (ffn.up_proj.bias is not None) == bias and (ffn.down_proj.bias is not None) == bias


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("activation", sorted(CLOSED_FORMS))
def test_glu_equals_act_gate_times_up_then_down(activation, bias):
    """SwiGLU / GeGLU (note 003): (act(x W_gate) * (x W_up)) W_down."""
    ffn = randomise(GLU(6, 10, activation=activation, bias=bias))
    x = torch.randn(2, 3, 6, dtype=torch.float64)
    hidden = CLOSED_FORMS[activation](linear(x, ffn.gate_proj)) * linear(x, ffn.up_proj)
    torch.testing.assert_close(ffn(x), linear(hidden, ffn.down_proj), rtol=1e-10, atol=1e-10)


def test_swiglu_is_glu_over_silu():
    ffn = randomise(GLU(4, 8, activation="silu", bias=False))
    x = torch.randn(5, 4, dtype=torch.float64)
    gate, up = x @ ffn.gate_proj.weight.T, x @ ffn.up_proj.weight.T
    expected = (gate * torch.sigmoid(gate) * up) @ ffn.down_proj.weight.T
    torch.testing.assert_close(ffn(x), expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("name", FFNS.names())
def test_position_wise_ffn_row_by_row_equals_matrix_form(name):
    """SPEC claim 7: FFN applied to each position separately == FFN on the (B, T, D) tensor."""
    ffn = randomise(FFNS.get(name)(8, 16, activation="gelu", bias=True))
    x = torch.randn(3, 7, 8, dtype=torch.float64)
    rows = torch.stack([torch.stack([ffn(x[b, t]) for t in range(7)]) for b in range(3)])
    torch.testing.assert_close(ffn(x), rows, rtol=1e-12, atol=1e-12)


def test_ffn_registry_holds_mlp_and_glu():
    assert {"mlp", "glu"} <= set(FFNS.names())
    assert FFNS.get("mlp") is MLP and FFNS.get("glu") is GLU
