"""Named registries: one per variant axis (norms, positionals, kernels, ...).

A registry maps a name to a factory; every entry of one registry shares one signature,
so choosing a variant is a lookup, never an if/else ladder (DESIGN.md, STYLE.md 4).
"""
from __future__ import annotations

from typing import Callable, Generic, Iterator, TypeVar

from qkv.errors import QkvError

T = TypeVar("T")


class Registry(Generic[T]):
    """A name -> object table with errors that list the choices."""

    def __init__(self, kind: str):
        self.kind = kind
        self._entries: dict[str, T] = {}

    def register(self, name: str) -> Callable[[T], T]:
        def add(obj: T) -> T:
            if name in self._entries:
                raise ValueError(f"{self.kind} {name!r} is registered twice")
            self._entries[name] = obj
            return obj

        return add

    def get(self, name: str) -> T:
        try:
            return self._entries[name]
        except KeyError:
            raise QkvError(
                f"unknown {self.kind} {name!r}; choose from: {', '.join(self.names())}"
            ) from None

    def check(self, key: str, value: object) -> None:
        """QkvError naming the config field `key` unless `value` is a registered name."""
        if value not in self._entries:
            raise QkvError(f"{key}={value!r} is not allowed; choose from: {', '.join(self.names())}")

    def names(self) -> list[str]:
        return sorted(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        return len(self._entries)
