"""How config fields are typed, parsed and bounded: the value rules every section of qkv.config shares
(a leaf: it imports nothing of qkv but qkv.errors)."""
from __future__ import annotations

import math
import typing
from typing import Any

from qkv.errors import QkvError


def field_types(cls) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def coerce(key: str, value: Any, kind: Any) -> Any:
    """Check a JSON value against a field's type (ints are accepted for floats; lists for tuples)."""
    if kind is bool:
        ok = isinstance(value, bool)
    elif kind is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif kind is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        value = float(value) if ok else value
    elif kind is str:
        ok = isinstance(value, str)
    elif _numbers(kind):  # tuple[float, ...]
        ok = isinstance(value, (list, tuple)) and all(isinstance(v, (int, float)) and not isinstance(v, bool)
                                                      for v in value)
        value = tuple(float(v) for v in value) if ok else value
    elif _integers(kind):  # tuple[int, ...]
        ok = isinstance(value, (list, tuple)) and all(isinstance(v, int) and not isinstance(v, bool) for v in value)
        value = tuple(value) if ok else value
    else:  # tuple[str, ...]
        ok = isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value)
        value = tuple(value) if ok else value
    if not ok:
        raise QkvError(f"{key}={value!r} has the wrong type; expected {_type_name(kind)}")
    return value


def parse_value(key: str, text: str, kind: Any) -> Any:
    """Parse a command-line string to a field's type."""
    try:
        if kind is bool:
            lowered = text.lower()
            if lowered not in ("true", "false", "1", "0"):
                raise ValueError
            return lowered in ("true", "1")
        if kind is int:
            return int(text)
        if kind is float:
            return float(text)
        if kind is str:
            return text
        parts = tuple(part for part in text.split(",") if part)
        if _integers(kind):
            return tuple(int(part) for part in parts)
        return tuple(float(part) for part in parts) if _numbers(kind) else parts
    except ValueError:
        raise QkvError(f"{key}={text!r} is not a valid {_type_name(kind)}") from None


def _numbers(kind: Any) -> bool:
    """tuple[float, ...] (a list of numbers in JSON; comma-separated on the command line)."""
    return typing.get_origin(kind) is tuple and typing.get_args(kind)[:1] == (float,)


def _integers(kind: Any) -> bool:
    """tuple[int, ...] (a list of integers in JSON; comma-separated on the command line)."""
    return typing.get_origin(kind) is tuple and typing.get_args(kind)[:1] == (int,)


def _type_name(kind: Any) -> str:
    # tuple[str, ...] is a GenericAlias whose __name__ is "tuple": name it the way JSON writes it
    if isinstance(kind, type):
        return kind.__name__
    return "list of numbers" if _numbers(kind) else "list of integers" if _integers(kind) else "list of strings"


def _no_unknown(where: str, raw: dict, allowed) -> None:
    for key in raw:
        if key not in allowed:
            raise QkvError(f"{where}: unknown key {key!r}; choose from: {', '.join(allowed)}")


def choice(key: str, value: Any, allowed) -> None:
    if value not in allowed:
        raise QkvError(f"{key}={value!r} is not allowed; choose from: {', '.join(map(str, allowed))}")


MAX_VOCAB, INT_LIMIT = 2 ** 20, 2 ** 62  # data.vocab_size's ceiling; any integer field's (|value|)


def _finite_and_bounded(section: str, values) -> None:
    """Each field of its type, floats finite (an infinite learning rate trained a NaN run to the end),
    integers within +-INT_LIMIT: before any other check reads them."""
    for name, kind in field_types(type(values)).items():
        key, value = f"{section}.{name}", getattr(values, name)
        coerce(key, value, kind)
        if isinstance(value, float) and not math.isfinite(value) or _numbers(kind) and not all(
                math.isfinite(v) for v in value):
            raise QkvError(f"{key}={value} must be " + ("finite numbers" if _numbers(kind) else "a finite number"))
        if isinstance(value, int) and not isinstance(value, bool) and abs(value) > INT_LIMIT or _integers(kind) and any(
                abs(v) > INT_LIMIT for v in value):
            raise QkvError(f"{key}={value} is out of range (|value| <= 2^62)")


def _positive(key: str, value: float) -> None:
    if not value > 0:
        raise QkvError(f"{key}={value} must be positive")


def _at_least(key: str, value: float, low: float) -> None:
    if not value >= low:
        raise QkvError(f"{key}={value} must be at least {low}")
