"""The SPEC claims as computations (`qkv verify`, SPEC F4): each claim is a function that measures and
returns a `Result`; none asserts anything it did not compute.

status: `holds` (the note is right and the measurement shows it), `corrected` (the note is wrong; the
correct statement was measured and holds), `fails` (the measurement does not support the statement the
system implements: a bug to fix). Claims are registered by number with the note and section they test.
"""
from qkv.claims.base import CLAIMS, Claim, Result, claim, status
# The package is assembled here: each module registers its claims in CLAIMS when imported.
from qkv.claims import attention, gradients, positional, scale, training  # noqa: E402,F401,I001

__all__ = ["CLAIMS", "Claim", "Result", "claim", "load_all", "status"]


def load_all() -> dict[int, Claim]:
    return CLAIMS
