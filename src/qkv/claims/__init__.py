"""The SPEC claims as computations (`qkv verify`, SPEC F4): each claim is a function that measures and
returns a `Result`; none asserts anything it did not compute.

status: `holds` (the note is right and the measurement shows it), `corrected` (the note is wrong; the
correct statement was measured and holds), `fails` (the measurement does not support the statement the
system implements: a bug to fix). Claims are registered by number with the note and section they test.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable


@dataclass
class Result:
    status: str  # holds | corrected | fails
    measured: dict = field(default_factory=dict)
    note: str = ""  # what the note gets wrong and what is true, or how the measurement was made


@dataclass(frozen=True)
class Claim:
    id: int
    claim: str
    seed: str  # note and section
    check: Callable[[], Result]


CLAIMS: dict[int, Claim] = {}


def claim(number: int, text: str, seed: str):
    def register(fn: Callable[[], Result]) -> Callable[[], Result]:
        if number in CLAIMS:
            raise ValueError(f"claim {number} is registered twice")
        CLAIMS[number] = Claim(number, text, seed, fn)
        return fn
    return register


def status(ok: bool, when_ok: str = "holds") -> str:
    """`when_ok` if the measurement supports the (corrected) statement, else `fails`."""
    return when_ok if ok else "fails"


def load_all() -> dict[int, Claim]:
    from qkv.claims import attention, gradients, positional, scale, training  # noqa: F401  (register)

    return CLAIMS
