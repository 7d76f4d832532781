"""The check every tests/ref/test_<module>.py runs on its module's layer cases: the hand-written backward
of qkv.ref against torch autograd with the same random upstream gradient (float64, atol 1e-10), and the
forward against the same independent torch implementation (tests/ref/torch_oracles.py)."""
from __future__ import annotations

import numpy as np
import torch

from qkv.ref import gradcheck
from tests.ref.torch_oracles import ORACLES

TOL = 1e-10


def cases(*prefixes: str) -> list[str]:
    """The layer cases whose names start with one of `prefixes` (each module's test file names its own)."""
    found = [n for n in gradcheck.CASES.names() if n.startswith(prefixes)]
    assert found, f"no case starts with {prefixes}"
    return found


def _to_torch(value):
    if value is None or not isinstance(value, np.ndarray):
        return value
    tensor = torch.from_numpy(value.copy())
    return tensor.requires_grad_() if tensor.is_floating_point() else tensor


def check_against_torch(case: str) -> None:
    spec = gradcheck.CASES.get(case)
    rng = np.random.default_rng(2)
    inputs = spec.inputs(rng)
    y, cache = spec.forward(inputs)
    dy = gradcheck.upstream(rng, y)
    ours = spec.backward(dy, cache)

    tensors = {name: _to_torch(value) for name, value in inputs.items()}
    y_torch = ORACLES[case](tensors)
    np.testing.assert_allclose(np.asarray(y), y_torch.detach().numpy(), rtol=0, atol=TOL)
    names = spec.wrt or tuple(ours)
    theirs = torch.autograd.grad(y_torch, [tensors[n] for n in names], torch.from_numpy(np.asarray(dy)),
                                 allow_unused=True)
    for name, grad in zip(names, theirs):
        expected = np.zeros_like(ours[name]) if grad is None else grad.numpy()
        np.testing.assert_allclose(ours[name], expected, rtol=0, atol=TOL, err_msg=f"{case}: {name}")
