import pytest

from qkv.errors import QkvError
from qkv.nn import registries
from qkv.registry import Registry


def make_registry() -> Registry:
    reg: Registry = Registry("widget")
    reg.register("beta")(lambda: "b")
    reg.register("alpha")(lambda: "a")
    return reg


def test_get_returns_the_registered_object_and_register_returns_it_unchanged():
    reg: Registry = Registry("widget")

    def factory():
        return 42

    assert reg.register("f")(factory) is factory
    assert reg.get("f") is factory and reg.get("f")() == 42


def test_names_are_sorted_and_iteration_len_contains_agree():
    reg = make_registry()
    assert reg.names() == ["alpha", "beta"]
    assert list(reg) == ["alpha", "beta"]
    assert len(reg) == 2
    assert "alpha" in reg and "gamma" not in reg


def test_unknown_name_is_a_qkv_error_naming_the_kind_the_value_and_every_choice():
    reg = make_registry()
    with pytest.raises(QkvError) as info:
        reg.get("gamma")
    message = str(info.value)
    assert message == "unknown widget 'gamma'; choose from: alpha, beta"
    assert "\n" not in message


def test_registering_a_name_twice_is_refused_and_keeps_the_first():
    reg = make_registry()
    with pytest.raises(ValueError, match="'alpha' is registered twice"):
        reg.register("alpha")(lambda: "other")
    assert reg.get("alpha")() == "a"


@pytest.mark.parametrize("axis", sorted(registries.AXES))
def test_every_model_axis_lists_its_choices_on_an_unknown_name(axis):
    reg = registries.get(axis)
    assert len(reg) >= 1
    with pytest.raises(QkvError) as info:
        reg.get("no-such-variant")
    assert "'no-such-variant'" in str(info.value)
    assert str(info.value).endswith("choose from: " + ", ".join(reg.names()))


def test_every_axis_is_a_model_field_whose_default_is_registered():
    from qkv.config import ModelConfig

    defaults = ModelConfig()
    assert all(getattr(defaults, axis) in registries.get(axis) for axis in registries.AXES)
