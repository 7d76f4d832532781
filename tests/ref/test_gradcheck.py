"""Every hand-written backward of qkv.ref against central finite differences (float64, rtol 1e-6)."""
import numpy as np
import pytest

from qkv.ref import gradcheck


@pytest.mark.parametrize("case", gradcheck.CASES.names())
def test_backward_matches_finite_differences(case):
    checks = gradcheck.check_fd(case, seed=1)
    assert checks, f"{case}: nothing checked"
    failed = [c for c in checks if not c.passed]
    assert not failed, failed


def test_a_wrong_backward_is_caught():
    """The harness itself: a backward off by a factor of 2 on one input fails."""
    name = "test-wrong-linear"
    if name not in gradcheck.CASES:
        linear = gradcheck.CASES.get("linear")
        gradcheck.CASES.register(name)(gradcheck.Case(
            linear.inputs, linear.forward,
            lambda dy, c: {**linear.backward(dy, c), "x": 2 * linear.backward(dy, c)["x"]}))
    checks = {c.name: c.passed for c in gradcheck.check_fd(name)}
    assert checks == {f"{name}: x": False, f"{name}: p.weight": True, f"{name}: p.bias": True}


def test_layernorm_jacobian_claim_9():
    result = gradcheck.layernorm_jacobian(d=8)
    assert result["backward_vs_fd"] < 1e-8
    assert result["corrected_vs_backward"] < 1e-12
    assert result["note_table_vs_backward"] > 0.1  # the summary table's form is wrong (lacks 1/d on xhat xhat^T)


def test_softmax_ce_gradient_claim_10():
    result = gradcheck.softmax_ce_gradient()
    assert result["closed_vs_backward"] < 1e-15 and result["closed_vs_fd"] < 1e-8


def test_softmax_row_rule_claim_11():
    result = gradcheck.softmax_row_rule()
    assert result["rule_vs_jacobian"] < 1e-14 and result["rule_vs_fd"] < 1e-8


def test_embedding_scatter_add_claim_13():
    result = gradcheck.embedding_scatter_add()
    assert result == {"lookup_vs_matmul": 0.0, "scatter_vs_matmul": 0.0}


def test_numerical_grad_of_a_known_function():
    x = np.array([0.3, -1.2, 2.0])
    grad = gradcheck.numerical_grad(lambda: float((x ** 3).sum()), x)
    np.testing.assert_allclose(grad, 3 * x ** 2, rtol=1e-9)
