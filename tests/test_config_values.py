"""The value rules every config section shares (qkv.config_values): JSON types, command-line parsing, and
one `QkvError` line naming the key for every value outside its rule."""
import math
from dataclasses import dataclass

import pytest

from qkv.config_values import (INT_LIMIT, _finite_and_bounded, _no_unknown, choice, coerce, field_types,
                               parse_value)
from qkv.errors import QkvError


@dataclass
class Section:
    flag: bool = False
    count: int = 1
    rate: float = 0.5
    name: str = "x"
    paths: tuple[str, ...] = ()
    factors: tuple[float, ...] = ()


KINDS = field_types(Section)


@pytest.mark.parametrize("field,value,want", [
    ("flag", True, True), ("count", 3, 3), ("rate", 2, 2.0), ("rate", 0.25, 0.25), ("name", "a", "a"),
    ("paths", ["a", "b"], ("a", "b")), ("factors", [1, 2.5], (1.0, 2.5)),
])
def test_coerce_accepts_json_values_of_the_fields_type(field, value, want):
    got = coerce(f"s.{field}", value, KINDS[field])
    assert got == want and type(got) is type(want)


@pytest.mark.parametrize("field,value", [
    ("flag", 1), ("count", True), ("count", 1.5), ("rate", False), ("rate", "0.1"), ("name", 3),
    ("paths", "a"), ("paths", ["a", 1]), ("factors", ["1.0"]), ("factors", [True]),
])
def test_coerce_refuses_other_types_naming_the_key(field, value):
    """A bool is not an int (nor an int a bool): JSON's true must not pass for 1."""
    with pytest.raises(QkvError, match=rf"s\.{field}=.* has the wrong type"):
        coerce(f"s.{field}", value, KINDS[field])


@pytest.mark.parametrize("field,text,want", [
    ("flag", "true", True), ("flag", "0", False), ("flag", "False", False), ("count", "-7", -7),
    ("rate", "1e-3", 1e-3), ("name", "rope", "rope"), ("paths", "a,b,", ("a", "b")), ("paths", "", ()),
    ("factors", "1,2.5e0", (1.0, 2.5)),
])
def test_parse_value_reads_the_command_line_form(field, text, want):
    assert parse_value(f"s.{field}", text, KINDS[field]) == want


@pytest.mark.parametrize("field,text", [("flag", "yes"), ("count", "1.5"), ("count", "ten"), ("rate", "fast"),
                                        ("factors", "1,x")])
def test_parse_value_refuses_what_is_not_that_type(field, text):
    with pytest.raises(QkvError, match=rf"s\.{field}='{text}' is not a valid"):
        parse_value(f"s.{field}", text, KINDS[field])


def test_unknown_keys_and_choices_name_what_is_allowed():
    with pytest.raises(QkvError, match="unknown key 'colour'; choose from: flag, count"):
        _no_unknown("s", {"colour": 1}, ["flag", "count"])
    with pytest.raises(QkvError, match="s.name='z' is not allowed; choose from: x, y"):
        choice("s.name", "z", ("x", "y"))
    choice("s.name", "x", ("x", "y"))  # allowed: no error


@pytest.mark.parametrize("field,value,message", [
    ("rate", math.inf, "must be a finite number"), ("rate", math.nan, "must be a finite number"),
    ("count", INT_LIMIT + 1, "out of range"), ("count", -INT_LIMIT - 1, "out of range"),
])
def test_non_finite_and_huge_values_are_refused(field, value, message):
    with pytest.raises(QkvError, match=rf"s\.{field}=.*{message}"):
        _finite_and_bounded("s", Section(**{field: value}))
    _finite_and_bounded("s", Section(count=INT_LIMIT))  # the limit itself is allowed
