"""`qkv verify` (SPEC F4): all 31 claims computed in one run (shared by the tests below), none failing,
the notes' errors reported as `corrected`, the JSON fields and the readable table."""

import pytest

from qkv.claims import verify
from qkv.claims import load_all
from tests.analysis import run_cli

CORRECTED = {2, 9, 15, 23, 25, 31}  # where a note is wrong (SPEC.md, "Claims"; 15: its displayed theorem)
FIELDS = {"id", "claim", "seed", "status", "measured", "note"}


@pytest.fixture
def results(verified):
    return verified


def test_every_claim_is_registered_with_its_note_section():
    claims = load_all()
    assert sorted(claims) == list(range(1, 32))
    for c in claims.values():
        assert c.claim and any(note in c.seed for note in ("000", "002", "003"))


def test_all_claims_hold_or_are_corrected(results):
    assert [r["id"] for r in results] == list(range(1, 32))
    failing = {r["id"]: r["measured"] for r in results if r["status"] == "fails"}
    assert not failing
    assert {r["id"] for r in results if r["status"] == "corrected"} == CORRECTED
    assert sum(r["seconds"] for r in results) < 120


def test_json_fields(results):
    for r in results:
        assert FIELDS <= set(r) and r["status"] in verify.STATUSES
        assert r["measured"] and isinstance(r["measured"], dict)
    for r in results:
        if r["status"] == "corrected":
            assert len(r["note"]) > 40  # says what the note claims and what is true


def test_one_claim_and_table():
    rc, out, err = run_cli("verify", "--claim", "3")
    assert rc == 0, err
    assert out.startswith("[ 3] HOLDS") and "1 claims: 1 hold, 0 corrected, 0 fail" in out
    rc, _, err = run_cli("verify", "--claim", "32")
    assert rc == 2 and "no such claim" in err


def test_a_raising_claim_is_reported_as_failing(monkeypatch):
    claims = load_all()

    def broken():
        raise RuntimeError("boom")

    monkeypatch.setitem(claims, 7, claims[7].__class__(7, claims[7].claim, claims[7].seed, broken))
    (result,) = verify.run([7])
    assert result["status"] == "fails" and "boom" in result["measured"]["error"]
