"""qkv.formats.params: parameters between the torch engine and the reference engine."""
import numpy as np
import pytest
import torch

from qkv.errors import QkvError
from qkv.formats.params import grads_to_numpy, load_numpy, to_numpy
from qkv.models import build_model


def test_round_trip_keeps_names_shapes_and_values(tiny_cfg):
    model = build_model(tiny_cfg)
    params = to_numpy(model)
    assert list(params) == [name for name, _ in model.named_parameters()]
    assert "lm_head.weight" not in params  # tied: one tensor, one entry
    assert all(v.dtype == np.float64 for v in params.values())
    changed = {name: value + 1.0 for name, value in params.items()}
    load_numpy(model, changed)
    for name, p in model.named_parameters():
        assert p.dtype == torch.float32  # the model keeps its dtype
        np.testing.assert_allclose(p.detach().numpy(), changed[name], rtol=1e-6)
    assert model.lm_head.weight is model.tok_emb.weight  # loading does not untie


def test_load_rejects_wrong_names_and_shapes(tiny_cfg):
    model = build_model(tiny_cfg)
    params = to_numpy(model)
    with pytest.raises(QkvError, match="missing"):
        load_numpy(model, {k: v for k, v in params.items() if k != "tok_emb.weight"})
    with pytest.raises(QkvError, match="tok_emb.weight: shape"):
        load_numpy(model, {**params, "tok_emb.weight": np.zeros((1, 1))})


def test_grads_to_numpy(tiny_cfg):
    model = build_model(tiny_cfg).double()
    model(torch.zeros(1, 3, dtype=torch.long)).sum().backward()
    grads = grads_to_numpy(model)
    assert set(grads) == set(to_numpy(model))
    np.testing.assert_array_equal(grads["tok_emb.weight"], model.tok_emb.weight.grad.numpy())
