"""Every hand-written backward of qkv.ref against torch autograd with the same random upstream gradient
(float64, atol 1e-10), and every forward against the same torch implementation."""
import numpy as np
import pytest
import torch

from qkv.ref import gradcheck
from tests.ref.torch_oracles import ORACLES


def test_every_layer_case_has_a_torch_oracle():
    """Whole-model cases ("model_*": the loss of a whole decoder along random directions) are proved by
    finite differences here; whole models meet torch in tests/ref/test_models.py."""
    layer_cases = [n for n in gradcheck.CASES.names() if not n.startswith(("test-", "model_"))]
    assert sorted(ORACLES) == layer_cases


def _to_torch(value):
    if value is None or not isinstance(value, np.ndarray):
        return value
    tensor = torch.from_numpy(value.copy())
    return tensor.requires_grad_() if tensor.is_floating_point() else tensor


@pytest.mark.parametrize("case", sorted(ORACLES))
def test_backward_matches_torch_autograd(case):
    spec = gradcheck.CASES.get(case)
    rng = np.random.default_rng(2)
    inputs = spec.inputs(rng)
    y, cache = spec.forward(inputs)
    dy = gradcheck.upstream(rng, y)
    ours = spec.backward(dy, cache)

    tensors = {name: _to_torch(value) for name, value in inputs.items()}
    y_torch = ORACLES[case](tensors)
    np.testing.assert_allclose(np.asarray(y), y_torch.detach().numpy(), rtol=0, atol=1e-10)
    names = spec.wrt or tuple(ours)
    theirs = torch.autograd.grad(y_torch, [tensors[n] for n in names], torch.from_numpy(np.asarray(dy)),
                                 allow_unused=True)
    for name, grad in zip(names, theirs):
        expected = np.zeros_like(ours[name]) if grad is None else grad.numpy()
        np.testing.assert_allclose(ours[name], expected, rtol=0, atol=1e-10, err_msg=f"{case}: {name}")
