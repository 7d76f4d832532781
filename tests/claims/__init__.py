"""Each claim's measured figures (from the session's `qkv verify --json`, tests/conftest.py) against a closed
form or bound derived here, independently of the claim's own verdict."""
from __future__ import annotations


def measured(results: list[dict], number: int) -> dict:
    (result,) = [r for r in results if r["id"] == number]
    assert result["status"] != "fails", result
    return result["measured"]
