import torch

from qkv.nn.norms import LayerNorm
from qkv.nn.residual import RESIDUALS, NormPair, post_norm, pre_norm, sandwich_norm, sublayer_norm


def layer_norm(x, eps=1e-5):
    mu = x.mean(-1, keepdim=True)
    return (x - mu) / torch.sqrt(((x - mu) ** 2).mean(-1, keepdim=True) + eps)


def test_registry_holds_pre_post_and_sandwich():
    assert RESIDUALS.names() == ["post", "pre", "sandwich"]
    assert RESIDUALS.get("pre").apply is pre_norm and RESIDUALS.get("post").apply is post_norm
    assert RESIDUALS.get("sandwich").apply is sandwich_norm


def sublayer_and_inputs():
    W = torch.randn(8, 8, dtype=torch.float64)
    x = torch.randn(3, 8, dtype=torch.float64)
    return (lambda z, scale=1.0: torch.tanh(z @ W) * scale), x, W


def test_pre_norm_is_x_plus_f_of_ln_x():
    f, x, _ = sublayer_and_inputs()
    norm = LayerNorm(8, eps=1e-5).double()
    torch.testing.assert_close(pre_norm(x, norm, f), x + f(layer_norm(x)), rtol=1e-12, atol=1e-12)


def test_post_norm_is_ln_of_x_plus_f_x():
    """Post-LN is LN(x + F(x)) (the original Transformer), not note 002's x + LN(F(x))."""
    f, x, _ = sublayer_and_inputs()
    norm = LayerNorm(8, eps=1e-5).double()
    out = post_norm(x, norm, f)
    torch.testing.assert_close(out, layer_norm(x + f(x)), rtol=1e-12, atol=1e-12)
    assert (out - (x + layer_norm(f(x)))).abs().max() > 1e-2


def test_extra_arguments_reach_the_sublayer():
    f, x, _ = sublayer_and_inputs()
    identity = torch.nn.Identity()
    torch.testing.assert_close(pre_norm(x, identity, f, 2.0), x + 2.0 * f(x), rtol=0, atol=0)
    torch.testing.assert_close(post_norm(x, identity, f, 3.0), x + 3.0 * f(x), rtol=0, atol=0)


def test_residual_jacobian_is_identity_plus_sublayer_jacobian():
    """SPEC claim 8: d(x + F(x))/dx = I + dF/dx."""
    W = torch.randn(6, 6, dtype=torch.float64)
    x = torch.randn(6, dtype=torch.float64)
    jac = torch.autograd.functional.jacobian(lambda z: pre_norm(z, torch.nn.Identity(), lambda u: u @ W), x)
    torch.testing.assert_close(jac, torch.eye(6, dtype=torch.float64) + W.T, rtol=1e-12, atol=1e-12)


def test_sandwich_is_x_plus_ln_out_of_f_of_ln_in_x():
    """x + LN_out(F(LN_in(x))) with two distinct norms (different gains, so swapping them would show)."""
    f, x, _ = sublayer_and_inputs()
    pair = NormPair(LayerNorm(8, eps=1e-5).double(), LayerNorm(8, eps=1e-5).double())
    with torch.no_grad():
        pair.inner.weight.copy_(torch.linspace(0.5, 2.0, 8))
        pair.outer.weight.copy_(torch.linspace(2.0, 0.5, 8))
        pair.outer.bias.fill_(0.3)
    expected = x + (layer_norm(f(layer_norm(x) * pair.inner.weight)) * pair.outer.weight + 0.3)
    torch.testing.assert_close(sandwich_norm(x, pair, f), expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(sandwich_norm(x, pair, f, 2.0) - x, pair.outer(2.0 * f(pair.inner(x))),
                               rtol=1e-12, atol=1e-12)


def test_every_placement_gets_the_norms_it_needs():
    made = []

    def make():
        made.append(LayerNorm(4, eps=1e-5))
        return made[-1]

    for placement in RESIDUALS.names():
        norm = sublayer_norm(placement, make)
        assert isinstance(norm, NormPair) == (placement == "sandwich")
    assert [RESIDUALS.get(p).final_norm for p in RESIDUALS.names()] == [False, True, True]
