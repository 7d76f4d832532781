"""What every claim is: its number, text and seed, and the `Result` its computation returns (qkv.claims)."""
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
