"""Modern -> First Folio alignment (qkv.data.folio): spelling folds and keys, the speaker prefix, line alignment
on a hand-written fixture (known pairs come out, unrelated lines are dropped, order is kept), the twins table,
the work-level split and the on-disk cache."""
import json

import pytest

from qkv.data import folio
from qkv.data.corpus import VALIDATION_WORKS, Document, bundled_documents

MODERN = """HAMLET.
To be, or not to be, that is the question:
Whether 'tis nobler in the mind to suffer
The slings and arrows of outrageous fortune,

[Exit.]

A wholly different line the Folio never printed.
And fortune, on his damned quarrel smiling,
Upon the heath.
Hover through the fog and filthy air.
"""

FOLIO = """Actus Primus. Scoena Prima.

   Ham. To be, or not to be, that is the Question:
Whether 'tis Nobler in the minde to suffer
The Slings and Arrowes of outragious Fortune,
Exit.

Some other verse that the modern editors cut away
And Fortune on his damned Quarry smiling,
  2. Vpon the Heath
Houer through the fogge and filthie ayre.
"""

EXPECTED = [
    ("To be, or not to be, that is the question:", "To be, or not to be, that is the Question:"),
    ("Whether 'tis nobler in the mind to suffer", "Whether 'tis Nobler in the minde to suffer"),
    ("The slings and arrows of outrageous fortune,", "The Slings and Arrowes of outragious Fortune,"),
    ("[Exit.]", "Exit."),  # the same stage direction, printed without brackets
    ("And fortune, on his damned quarrel smiling,", "And Fortune on his damned Quarry smiling,"),
    ("Upon the heath.", "Vpon the Heath"),
    ("Hover through the fog and filthy air.", "Houer through the fogge and filthie ayre."),
]


def test_fold_and_key_are_spelling_blind():
    assert folio.fold("Vpon the Heath!") == folio.fold("upon the heath") == "upontheheath"
    assert folio.fold("Iustice") == folio.fold("justice") == "iustice"
    assert folio.fold("ſweet") == "sweet"
    for old, new in (("againe", "again"), ("Sunne", "sun"), ("supply'd", "supplied"), ("filthie ayre", "filthy air"),
                     ("Houer", "hover"), ("fogge", "fog")):
        assert folio.key(old) == folio.key(new), (old, new)
    assert folio.key("the question") != folio.key("the answer")


def test_similarity_is_difflib_ratio_of_the_folded_letters():
    # "reuolt" vs "revolt" fold to the same letters; "abcd" vs "abce": 2 * 3 matches / 8 letters
    assert folio.similarity("Reuolt", "revolt") == 1.0
    assert folio.similarity("ab cd", "a-b-c-e") == pytest.approx(0.75)
    assert folio.similarity("abc", "xyz") == 0.0


def test_usable_lines_cut_the_folio_speaker_prefix_and_short_lines():
    assert folio.usable_lines(FOLIO, folio=True)[:3] == [
        "Actus Primus. Scoena Prima.", "To be, or not to be, that is the Question:",
        "Whether 'tis Nobler in the minde to suffer"]
    assert "Vpon the Heath" in folio.usable_lines(FOLIO, folio=True)  # "  2. " is a speaker prefix
    modern = folio.usable_lines(MODERN, folio=False)
    assert modern[0] == "HAMLET." and "[Exit.]" in modern and "" not in modern
    assert folio.usable_lines("O!\n  Ham. Ay.\nGo.\nTo be", folio=True) == ["To be"]  # under MIN_LETTERS


def test_alignment_on_a_fixture_keeps_known_pairs_in_order_and_drops_the_rest():
    work = folio.align_work(Document("m", MODERN, "Fixture"), Document("f", FOLIO, "Fixture"))
    assert list(work.pairs) == EXPECTED
    # the emended line ("quarrel" / "Quarry") has another key and is found by the gap alignment
    assert folio.key(EXPECTED[4][0]) != folio.key(EXPECTED[4][1])
    assert (work.modern_lines, work.folio_lines) == (9, 9)
    lines = work.document().text.split("\n")
    assert lines == [f"{a}\t{b}" for a, b in EXPECTED]


def test_gap_pairs_is_the_best_monotone_pairing():
    a = ["the moon doth shine", "upon the silver sea", "and all the river runs"]
    b = ["and all the riuer runnes", "the Moone doth shine", "vpon the siluer Sea"]
    # two lines in order beat one: the crossing pair (a[2], b[0]) is left out
    assert folio.gap_pairs([folio.fold(x) for x in a], [folio.fold(y) for y in b]) == [(0, 1), (1, 2)]
    assert folio.gap_pairs([folio.fold("abc def ghi")], [folio.fold("xyz uvw rst")]) == []


def test_twins_pair_every_folio_work_once_and_the_held_out_works_are_the_corpus_ones():
    modern = {doc.id for doc in bundled_documents("modern")}
    folio_ids = {doc.id for doc in bundled_documents("first-folio")}
    assert set(folio.TWINS) <= modern and set(folio.TWINS.values()) == folio_ids and len(folio.TWINS) == 35
    assert folio.HELD_OUT == tuple(w for w in VALIDATION_WORKS if w != "sonnets_gut")


def test_split_is_by_whole_works(monkeypatch, tmp_path):
    """Each work's pairs go to one side: the held-out works' pairs are exactly the validation documents."""
    def first_line(modern: Document, twin: Document) -> folio.AlignedWork:  # a stand-in for the slow alignment
        return folio.AlignedWork(modern.id, twin.id, modern.title, 1, 1, ((modern.id, twin.id),))

    monkeypatch.setenv("QKV_CACHE", str(tmp_path))
    monkeypatch.setattr(folio, "align_work", first_line)
    monkeypatch.setattr(folio, "_ALIGNED", {})
    train, val = folio.folio_split()
    assert [doc.id for doc in val] == [f"{w}+folio" for w in folio.HELD_OUT]
    assert len(train) == 31 and not {doc.id for doc in train} & {doc.id for doc in val}
    assert val[0].text == f"hamlet_gut\t{folio.TWINS['hamlet_gut']}"
    # the result is cached as JSON, keyed by the texts and the settings, and read back without aligning
    cached = list(tmp_path.glob("folio-*.json"))
    assert len(cached) == 1 and len(json.loads(cached[0].read_text())) == 35
    monkeypatch.setattr(folio, "_ALIGNED", {})
    monkeypatch.setattr(folio, "align_work", lambda *a: pytest.fail("aligned again despite the cache"))
    assert folio.folio_split() == (train, val)
