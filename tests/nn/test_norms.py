import pytest
import torch

from qkv.nn.norms import NORMS, LayerNorm, RMSNorm


def layernorm_closed_form(x, gamma, beta, eps):
    """gamma * (x - mu) / sqrt(sigma^2 + eps) + beta, sigma^2 the biased variance (note 000 §5.1)."""
    d = x.shape[-1]
    mu = x.sum(-1, keepdim=True) / d
    var = ((x - mu) ** 2).sum(-1, keepdim=True) / d
    return gamma * (x - mu) / torch.sqrt(var + eps) + beta


def rmsnorm_closed_form(x, gamma, eps):
    """gamma * x / sqrt(mean(x^2) + eps) (note 003)."""
    return gamma * x / torch.sqrt((x * x).sum(-1, keepdim=True) / x.shape[-1] + eps)


def randomise(norm):
    with torch.no_grad():
        for p in norm.parameters():
            p.copy_(torch.randn_like(p))
    return norm


def test_registry_holds_both_norms():
    assert NORMS.names() == ["layernorm", "rmsnorm"]
    assert NORMS.get("layernorm") is LayerNorm and NORMS.get("rmsnorm") is RMSNorm


def test_layernorm_matches_closed_form_fp32():
    norm = randomise(LayerNorm(24, eps=1e-5))
    x = torch.randn(3, 5, 24) * 3 + 1.5
    expected = layernorm_closed_form(x.double(), norm.weight.double(), norm.bias.double(), 1e-5)
    torch.testing.assert_close(norm(x).double(), expected, rtol=1e-5, atol=1e-5)


def test_layernorm_matches_closed_form_fp64_to_double_precision():
    norm = randomise(LayerNorm(24, eps=1e-5)).double()
    x = torch.randn(3, 5, 24, dtype=torch.float64) * 3 + 1.5
    y = norm(x)
    assert y.dtype == torch.float64
    torch.testing.assert_close(y, layernorm_closed_form(x, norm.weight, norm.bias, 1e-5), rtol=1e-12, atol=1e-12)


def test_layernorm_equals_torch_layernorm_values_and_gradients():
    ours = randomise(LayerNorm(16, eps=1e-6))
    theirs = torch.nn.LayerNorm(16, eps=1e-6)
    theirs.load_state_dict(ours.state_dict())
    x = torch.randn(4, 7, 16, requires_grad=True)
    upstream = torch.randn(4, 7, 16)
    y_ours = ours(x)
    (gx_ours, gw_ours, gb_ours) = torch.autograd.grad(y_ours, (x, ours.weight, ours.bias), upstream)
    y_theirs = theirs(x)
    (gx_theirs, gw_theirs, gb_theirs) = torch.autograd.grad(y_theirs, (x, theirs.weight, theirs.bias), upstream)
    torch.testing.assert_close(y_ours, y_theirs, rtol=1e-6, atol=1e-6)
    for a, b in [(gx_ours, gx_theirs), (gw_ours, gw_theirs), (gb_ours, gb_theirs)]:
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_layernorm_without_bias_has_no_beta_and_output_has_zero_mean_unit_variance_at_identity_gamma():
    norm = LayerNorm(64, eps=1e-8, bias=False)
    assert norm.bias is None and [n for n, _ in norm.named_parameters()] == ["weight"]
    y = norm(torch.randn(10, 64) * 5 - 2).double()
    torch.testing.assert_close(y.mean(-1), torch.zeros(10, dtype=torch.float64), rtol=0, atol=1e-6)
    torch.testing.assert_close(y.var(-1, unbiased=False), torch.ones(10, dtype=torch.float64), rtol=0, atol=1e-5)


def test_rmsnorm_matches_closed_form_fp32_and_fp64():
    norm = randomise(RMSNorm(24, eps=1e-6))
    x = torch.randn(2, 6, 24) * 2 + 0.7
    expected = rmsnorm_closed_form(x.double(), norm.weight.double(), 1e-6)
    torch.testing.assert_close(norm(x).double(), expected, rtol=1e-5, atol=1e-5)
    norm64 = norm.double()
    y = norm64(x.double())
    assert y.dtype == torch.float64
    torch.testing.assert_close(y, expected, rtol=1e-12, atol=1e-12)


def test_rmsnorm_has_only_a_gain_even_when_bias_is_asked_for():
    assert [n for n, _ in RMSNorm(8, eps=1e-6, bias=True).named_parameters()] == ["weight"]


def test_rmsnorm_equals_layernorm_without_bias_on_zero_mean_rows():
    """SPEC claim 29: with mean 0, the LayerNorm variance is mean(x^2), so the two coincide."""
    x = torch.randn(5, 32, dtype=torch.float64)
    x = x - x.mean(-1, keepdim=True)
    gamma = torch.randn(32, dtype=torch.float64)
    ln = LayerNorm(32, eps=1e-6, bias=False).double()
    rms = RMSNorm(32, eps=1e-6).double()
    with torch.no_grad():
        ln.weight.copy_(gamma)
        rms.weight.copy_(gamma)
    torch.testing.assert_close(ln(x), rms(x), rtol=1e-12, atol=1e-12)
    shifted = x + 1.0  # nonzero mean: they differ
    assert (ln(shifted) - rms(shifted)).abs().max() > 1e-2


@pytest.mark.parametrize("name", ["layernorm", "rmsnorm"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_inputs_keep_their_dtype_and_use_fp32_statistics(name, dtype):
    norm = randomise(NORMS.get(name)(32, eps=1e-5))
    x = (torch.randn(4, 32) * 4 + 3).to(dtype)
    y = norm.to(dtype)(x)
    assert y.dtype == dtype
    gamma = norm.weight.double()
    if name == "layernorm":
        expected = layernorm_closed_form(x.double(), gamma, norm.bias.double(), 1e-5)
    else:
        expected = rmsnorm_closed_form(x.double(), gamma, 1e-5)
    # only the final rounding to `dtype` is lost: within a couple of ulps of |y|
    ulp = torch.finfo(dtype).eps
    assert ((y.double() - expected).abs() <= 2 * ulp * expected.abs() + 1e-6).all()


@pytest.mark.parametrize("name", ["layernorm", "rmsnorm"])
def test_norm_is_invariant_to_scaling_the_row(name):
    """LN and RMSNorm divide by a scale statistic, so norm(c x) = norm(x) for c > 0 (eps aside)."""
    norm = randomise(NORMS.get(name)(16, eps=1e-12)).double()
    x = torch.randn(3, 16, dtype=torch.float64)
    torch.testing.assert_close(norm(7.5 * x), norm(x), rtol=1e-10, atol=1e-10)


def test_layernorm_jacobian_matches_the_closed_form():
    """SPEC claim 9: dx^_i/dx_j = (delta_ij - 1/d - x^_i x^_j / d) / sigma, sigma = sqrt(var + eps)."""
    d, eps = 10, 1e-5
    norm = LayerNorm(d, eps=eps).double()
    x = torch.randn(d, dtype=torch.float64) * 2 + 1
    sigma = torch.sqrt(x.var(unbiased=False) + eps)
    x_hat = (x - x.mean()) / sigma
    expected = (torch.eye(d, dtype=torch.float64) - 1 / d - torch.outer(x_hat, x_hat) / d) / sigma
    jacobian = torch.autograd.functional.jacobian(norm, x)
    torch.testing.assert_close(jacobian, expected, rtol=1e-10, atol=1e-12)


def test_rmsnorm_jacobian_matches_the_closed_form():
    """dy_i/dx_j = delta_ij / r - x_i x_j / (d r^3), r = sqrt(mean(x^2) + eps)."""
    d, eps = 10, 1e-5
    norm = RMSNorm(d, eps=eps).double()
    x = torch.randn(d, dtype=torch.float64)
    r = torch.sqrt((x * x).mean() + eps)
    expected = torch.eye(d, dtype=torch.float64) / r - torch.outer(x, x) / (d * r ** 3)
    torch.testing.assert_close(torch.autograd.functional.jacobian(norm, x), expected, rtol=1e-10, atol=1e-12)
