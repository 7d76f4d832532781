"""The variant axes (qkv.nn.registries): each registry is named by a ModelConfig field, holds that field's
default, and every name it offers builds a model or is refused by the same registry, one line."""
import dataclasses

import pytest

from qkv.config import ModelConfig
from qkv.errors import QkvError
from qkv.models.build import check_model
from qkv.nn import registries


def test_each_axis_is_a_model_field_with_its_default_registered():
    fields = {f.name: f.default for f in dataclasses.fields(ModelConfig)}
    for axis, registry in registries.AXES.items():
        assert axis in fields, axis
        assert fields[axis] in registry.names(), (axis, fields[axis])
        assert registries.get(axis) is registry


@pytest.mark.parametrize("axis", sorted(registries.AXES))
def test_every_name_is_accepted_and_an_unknown_one_refused(axis):
    for name in registries.get(axis).names():
        cfg = dataclasses.replace(ModelConfig(n_heads=4, d_model=64), **{axis: name}, window=8)
        check_model(cfg)  # names and the entry's facts (a window, an even head width) hold
    with pytest.raises(QkvError, match=axis):
        check_model(dataclasses.replace(ModelConfig(), **{axis: "no-such-name"}))
