import gzip
import json

import pytest

from qkv.data.corpus import (
    FIRST_FOLIO_VALIDATION_WORKS,
    VALIDATION_WORKS,
    Document,
    bundled_documents,
    bundled_split,
    content_hash,
    join,
    read_documents,
    split_documents,
)
from qkv.errors import QkvError


# ------------------------------------------------------------------------------------------ bundled corpus


def test_bundled_modern_split_holds_out_exactly_the_validation_works():
    docs = bundled_documents("modern")
    train, val = bundled_split("modern")
    assert len(docs) == 42 and len(train) == 37 and len(val) == 5
    assert sorted(d.id for d in val) == sorted(VALIDATION_WORKS)
    assert sorted(d.id for d in train + val) == sorted(d.id for d in docs)  # a partition
    ids = [d.id for d in docs]
    assert [d.id for d in train] == [i for i in ids if i not in VALIDATION_WORKS]  # file order kept
    assert all(d.spelling == "modern" and d.text and d.title for d in docs)
    assert train[0].id == "alls_well_that_ends_well_gut"


def test_bundled_first_folio_split_holds_out_the_folio_versions():
    docs = bundled_documents("first-folio")
    train, val = bundled_split("first-folio")
    assert len(docs) == 35 and len(train) == 31
    assert sorted(d.id for d in val) == sorted(FIRST_FOLIO_VALIDATION_WORKS)
    assert {d.id for d in train}.isdisjoint(FIRST_FOLIO_VALIDATION_WORKS)
    assert all(d.spelling == "first-folio" for d in docs)


def test_unknown_spelling_lists_choices():
    with pytest.raises(QkvError, match="modern, first-folio"):
        bundled_documents("elizabethan")


# ------------------------------------------------------------------------------------------ reading files


def test_reads_file_folder_and_glob_in_sorted_order(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "b.txt").write_text("bee\n", encoding="utf-8")
    (tmp_path / "a.txt").write_text("ay\r\n", encoding="utf-8")
    (tmp_path / "sub" / "c.txt").write_text("sea", encoding="utf-8")
    (tmp_path / "skip.md").write_text("not read", encoding="utf-8")
    from_folder = read_documents([str(tmp_path)])
    assert [d.text for d in from_folder] == ["ay\r\n", "bee\n", "sea"]  # text kept byte for byte
    assert [d.title for d in from_folder] == ["a", "b", "c"]
    from_glob = read_documents([str(tmp_path / "*.txt")])
    assert [d.text for d in from_glob] == ["ay\r\n", "bee\n"]
    assert [d.text for d in read_documents([str(tmp_path / "b.txt")])] == ["bee\n"]
    # a file named twice is read once
    assert len(read_documents([str(tmp_path / "a.txt"), str(tmp_path)])) == 3


def test_jsonl_and_gzipped_jsonl(tmp_path):
    lines = [json.dumps({"id": "one", "text": "first", "title": "T"}), "", json.dumps({"text": "second"})]
    plain = tmp_path / "d.jsonl"
    plain.write_text("\n".join(lines) + "\n", encoding="utf-8")
    zipped = tmp_path / "d.jsonl.gz"
    with gzip.open(zipped, "wt", encoding="utf-8") as handle:
        handle.write("\n".join(lines))
    for path in (plain, zipped):
        docs = read_documents([str(path)])
        assert [(d.id, d.text, d.title) for d in docs] == [("one", "first", "T"), (f"{path}:3", "second", "")]


def test_undecodable_bytes_name_file_and_offset(tmp_path):
    path = tmp_path / "bad.txt"
    path.write_bytes("héllo ".encode() + b"\xff rest")
    with pytest.raises(QkvError, match=r"bad\.txt.*0xff at byte offset 7"):
        read_documents([str(path)])


def test_utf8_byte_order_mark_is_not_text(tmp_path):
    path = tmp_path / "bom.txt"
    path.write_bytes(b"\xef\xbb\xbfhello")
    assert read_documents([str(path)])[0].text == "hello"


def test_malformed_json_line_names_file_and_line(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"text": "ok"}\n{"text": oops}\n', encoding="utf-8")
    with pytest.raises(QkvError, match=r"d\.jsonl:2: malformed JSON"):
        read_documents([str(path)])
    path.write_text('{"body": "no text field"}\n', encoding="utf-8")
    with pytest.raises(QkvError, match=r"d\.jsonl:1: .*\"text\""):
        read_documents([str(path)])


@pytest.mark.parametrize(
    "make, spec, message",
    [
        (lambda d: None, "missing.txt", "no such file or folder"),
        (lambda d: None, "nothing*.txt", "pattern matches no files"),
        (lambda d: (d / "empty").mkdir(), "empty", "folder has no .txt files"),
        (lambda d: (d / "blank.txt").write_text(" \n\n"), "blank.txt", "every document is empty"),
    ],
)
def test_bad_paths_are_named(tmp_path, make, spec, message):
    make(tmp_path)
    with pytest.raises(QkvError, match=message) as error:
        read_documents([str(tmp_path / spec)])
    assert spec in str(error.value)


def test_no_paths_is_an_error():
    with pytest.raises(QkvError, match="no data paths"):
        read_documents([])


# ------------------------------------------------------------------------------------------ splits, join, hash


def docs_of_lengths(*lengths):
    return [Document(id=f"d{i}", text="x" * n) for i, n in enumerate(lengths)]


def test_split_several_documents_takes_the_last_whole_ones():
    docs = docs_of_lengths(100, 100, 100, 100, 100)
    train, val = split_documents(docs, 0.4)
    assert [d.id for d in train] == ["d0", "d1", "d2"] and [d.id for d in val] == ["d3", "d4"]
    # at least one validation document, however small the fraction...
    assert [d.id for d in split_documents(docs, 0.01)[1]] == ["d4"]
    # ...and at least one training document, however large
    assert [d.id for d in split_documents(docs, 0.99)[0]] == ["d0"]


def test_split_single_document_cuts_its_tail_at_a_newline():
    text = "".join(f"line {i:03d}\n" for i in range(100))  # 9 characters a line, 900 in all
    train, val = split_documents([Document(id="play", text=text)], 0.1)
    assert train[0].text + val[0].text == text
    assert train[0].text.endswith("\n") and val[0].text.startswith("line ")
    assert abs(len(val[0].text) - 90) <= 9
    assert (train[0].id, val[0].id) == ("play#train", "play#val")
    # no newline at all: cut at the exact fraction
    train, val = split_documents([Document(id="x", text="a" * 100)], 0.25)
    assert (len(train[0].text), len(val[0].text)) == (75, 25)


@pytest.mark.parametrize("fraction", [0, 1, -0.5, 1.5])
def test_split_rejects_bad_fraction(fraction):
    with pytest.raises(QkvError, match="val_fraction"):
        split_documents(docs_of_lengths(10, 10), fraction)


def test_join_uses_a_blank_line():
    assert join([Document("a", "one"), Document("b", "two\n")]) == "one\n\ntwo\n"


def test_content_hash_separates_items_and_extras():
    base = content_hash(["ab", "c"], "512")
    assert base == content_hash(["ab", "c"], "512")
    assert len(base) == 64 and int(base, 16) >= 0
    assert base != content_hash(["a", "bc"], "512")  # same concatenation, different texts
    assert base != content_hash(["ab", "c", "512"])  # an extra is not a text
    assert base != content_hash(["ab", "c"], "513")
