"""qkv.ref.cases_relative: the learnt-bias cases feed exactly the torch engine's positional parameters (the
same names and shapes as its modules build), and their padding mask keeps each query's own key."""
import numpy as np
import pytest

from qkv.nn import positional as tpos
from qkv.ref import cases_relative
from qkv.ref.cases import D, Dh, H, T


@pytest.mark.parametrize("name", sorted(cases_relative.POSITIONAL_SHAPES))
def test_parameter_shapes_are_the_torch_modules(name):
    module = tpos.POSITIONALS.get(name)(d_model=D, n_heads=H, head_dim=Dh, max_seq_len=16, rope_theta=10000.0,
                                        max_distance=cases_relative.MAX_DISTANCE)
    shapes = {k: tuple(p.shape) for k, p in module.named_parameters()}
    assert shapes == cases_relative.POSITIONAL_SHAPES[name]


def test_every_relative_positional_meets_naive_flash_and_linear():
    spec = cases_relative.RELATIVE_CASES.values()
    for name in ("shaw", "xl", "t5"):
        kernels = {kernel for positional, kernel, _, _ in spec if positional.startswith(name)}
        assert {"naive", "flash"} <= kernels, name
    assert {kernel for _, kernel, _, _ in spec} == {"naive", "flash", "linear"}


@pytest.mark.parametrize("causal", [True, False])
def test_padding_mask_hides_the_left_pad_and_keeps_the_diagonal(causal):
    allowed = cases_relative.padding_mask(causal)[:, 0]  # (B, T, T)
    assert allowed[:, np.arange(T), np.arange(T)].all()
    assert not allowed[0, 2:, :2].any() and allowed[1, T - 1].all()
    if causal:
        assert not allowed[1][np.triu_indices(T, 1)].any()
