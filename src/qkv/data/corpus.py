"""Documents: the bundled Shakespeare corpus, user text files, train/validation splits.

A `Document` is plain text plus an id; nothing here tokenizes. Every bad-input path raises
`QkvError` with one line that names the file (and the line or byte offset where that helps).
"""

from __future__ import annotations

import glob
import gzip
import hashlib
import json
import os
from dataclasses import dataclass
from functools import lru_cache
from itertools import accumulate
from importlib.resources import files
from pathlib import Path
from typing import Sequence

from qkv.errors import QkvError

SPELLINGS = ("modern", "first-folio")
VALIDATION_WORKS = ("hamlet_gut", "julius_caesar_gut", "tempest_gut", "twelfth_night_gut", "sonnets_gut")
# The First Folio versions of the same works. Its Twelfth Night is spelled "Twelfe-Night"; the Sonnets
# are not in the Folio, so first-folio validation holds four works.
FIRST_FOLIO_VALIDATION_WORKS = ("hamlet_gut_f", "julius_caesar_gut_f", "tempest_gut_f", "twelfe-night_gut_f")
JOINER = "\n\n"  # between documents: a blank line
BUNDLED_CORPORA = {"shakespeare": "shakespeare.jsonl.gz"}  # data.corpus -> its file in qkv/data/corpora
BUNDLED_CORPUS = BUNDLED_CORPORA["shakespeare"]


@dataclass(frozen=True)
class Document:
    id: str
    text: str
    title: str = ""
    spelling: str = ""


# ---------------------------------------------------------------------------------------- bundled corpus


@lru_cache(maxsize=1)
def _bundled_all() -> tuple[Document, ...]:
    resource = files("qkv.data") / "corpora" / BUNDLED_CORPUS
    with resource.open("rb") as raw, gzip.GzipFile(fileobj=raw) as unzipped:
        lines = unzipped.read().decode("utf-8").splitlines()
    records = (json.loads(line) for line in lines if line.strip())
    return tuple(
        Document(id=r["id"], text=r["text"], title=r.get("title", ""), spelling=r.get("spelling", ""))
        for r in records
    )


def _check_spelling(spelling: str) -> None:
    if spelling not in SPELLINGS:
        raise QkvError(f"unknown spelling {spelling!r}; choose from {', '.join(SPELLINGS)}")


def bundled_documents(spelling: str = "modern") -> list[Document]:
    """The bundled Shakespeare works of one spelling, in file order."""
    _check_spelling(spelling)
    return [doc for doc in _bundled_all() if doc.spelling == spelling]


def bundled_split(spelling: str = "modern") -> tuple[list[Document], list[Document]]:
    """(train, val) of the bundled corpus: whole works held out, both lists in file order.

    modern: val = VALIDATION_WORKS. first-folio: val = FIRST_FOLIO_VALIDATION_WORKS, the Folio texts
    of the same works (there is no Folio Sonnets, so four works).
    """
    held_out = set(VALIDATION_WORKS if spelling == "modern" else FIRST_FOLIO_VALIDATION_WORKS)
    docs = bundled_documents(spelling)
    return [d for d in docs if d.id not in held_out], [d for d in docs if d.id in held_out]


# ---------------------------------------------------------------------------------------- user files


def _decode(data: bytes, name: str) -> str:
    try:
        return data.decode("utf-8-sig")  # a leading byte-order mark is not text
    except UnicodeDecodeError as error:
        raise QkvError(
            f"{name}: not UTF-8 text: undecodable byte 0x{data[error.start]:02x} at byte offset {error.start}"
        ) from None


def _read_bytes(path: Path) -> bytes:
    try:
        if path.name.endswith(".gz"):
            with gzip.open(path, "rb") as handle:
                return handle.read()
        return path.read_bytes()
    except (OSError, EOFError) as error:
        raise QkvError(f"{path}: cannot read: {error}") from None


def _read_jsonl(path: Path) -> list[Document]:
    text = _decode(_read_bytes(path), f"{path} (after decompression)" if path.name.endswith(".gz") else str(path))
    docs = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise QkvError(f"{path}:{number}: malformed JSON: {error.msg}") from None
        if not isinstance(record, dict) or not isinstance(record.get("text"), str):
            raise QkvError(f'{path}:{number}: expected a JSON object with a string "text" field')
        doc_id = str(record.get("id", f"{path}:{number}"))
        docs.append(Document(doc_id, record["text"], str(record.get("title", "")), str(record.get("spelling", ""))))
    return docs


def read_json_rows(spec: str) -> list[tuple[str, dict]]:
    """A .jsonl(.gz) file of JSON objects, one a line -> [(\"file:line\", object)]; blank lines skipped. A line
    that is not UTF-8, not JSON or not an object is an error naming it."""
    path = Path(spec)
    if not path.is_file():
        raise QkvError(f"{spec}: no such file")
    if not path.name.endswith((".jsonl", ".jsonl.gz")):
        raise QkvError(f"{spec}: expected a .jsonl or .jsonl.gz file (one JSON object a line)")
    rows = []
    for number, raw in enumerate(_read_bytes(path).split(b"\n"), start=1):
        origin = f"{path}:{number}"
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as error:
            raise QkvError(f"{origin}: not UTF-8 text (byte {error.start})") from None
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise QkvError(f"{origin}: malformed JSON: {error.msg}") from None
        if not isinstance(record, dict):
            raise QkvError(f"{origin}: expected a JSON object")
        rows.append((origin, record))
    return rows


def _read_one(path: Path) -> list[Document]:
    if path.name.endswith((".jsonl", ".jsonl.gz")):
        return _read_jsonl(path)
    return [Document(id=str(path), text=_decode(_read_bytes(path), str(path)), title=path.stem)]


def _expand(spec: str) -> list[Path]:
    """One command-line path -> the files it names."""
    path = Path(spec)
    if path.is_dir():
        found = sorted(p for p in path.rglob("*.txt") if p.is_file())
        if not found:
            raise QkvError(f"{spec}: folder has no .txt files")
        return found
    if path.is_file():
        return [path]
    if glob.has_magic(spec):
        matches = sorted(glob.glob(spec, recursive=True))
        if not matches:
            raise QkvError(f"{spec}: pattern matches no files")
        return [file for match in matches for file in _expand(match)]
    raise QkvError(f"{spec}: no such file or folder")


def read_documents(paths: Sequence[str]) -> list[Document]:
    """Text files, folders (*.txt, recursive), glob patterns and .jsonl(.gz) files -> documents.

    Files are read in the order given (folders and patterns sorted); a file named twice is read once.
    Documents with only whitespace are dropped; if nothing is left, that is an error.
    """
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    if not paths:
        raise QkvError("no data paths given")
    unique = dict.fromkeys(file for spec in paths for file in _expand(os.fspath(spec)))
    docs = [doc for file in unique for doc in _read_one(file)]
    kept = [doc for doc in docs if doc.text.strip()]
    if not kept:
        raise QkvError(f"no text in {', '.join(map(os.fspath, paths))}: every document is empty")
    return kept


# ---------------------------------------------------------------------------------------- splits


def _cut_near_newline(text: str, cut: int) -> int:
    """The position just after the newline nearest to `cut` (within 10% of the text), else `cut`."""
    reach = max(1, len(text) // 10)
    before = text.rfind("\n", max(0, cut - reach), cut)
    after = text.find("\n", cut, min(len(text) - 1, cut + reach))
    candidates = [p + 1 for p in (before, after) if p >= 0 and 0 < p + 1 < len(text)]
    return min(candidates, key=lambda p: abs(p - cut), default=cut)


def _split_one(doc: Document, val_fraction: float) -> tuple[list[Document], list[Document]]:
    if len(doc.text) < 2:
        raise QkvError(f"document {doc.id!r} is too short ({len(doc.text)} characters) to split off validation")
    cut = min(max(1, round(len(doc.text) * (1 - val_fraction))), len(doc.text) - 1)
    cut = _cut_near_newline(doc.text, cut)
    train = Document(f"{doc.id}#train", doc.text[:cut], doc.title, doc.spelling)
    val = Document(f"{doc.id}#val", doc.text[cut:], doc.title, doc.spelling)
    return [train], [val]


def split_documents(docs: Sequence[Document], val_fraction: float) -> tuple[list[Document], list[Document]]:
    """(train, val). Several documents: the last whole documents, about `val_fraction` of the characters
    (at least one, and at least one left to train on). One document: its tail, cut at a nearby newline."""
    if not 0 < val_fraction < 1:
        raise QkvError(f"val_fraction must be strictly between 0 and 1, got {val_fraction}")
    if not docs:
        raise QkvError("no documents to split")
    if len(docs) == 1:
        return _split_one(docs[0], val_fraction)
    tail_chars = list(accumulate(len(d.text) for d in reversed(docs)))  # [k - 1]: characters in the last k
    target = val_fraction * tail_chars[-1]
    held = 1
    while held < len(docs) - 1 and abs(tail_chars[held] - target) < abs(tail_chars[held - 1] - target):
        held += 1
    return list(docs[: len(docs) - held]), list(docs[len(docs) - held :])


def join(docs: Sequence[Document | str]) -> str:
    """Document texts (or plain strings) joined by a blank line."""
    return JOINER.join(doc if isinstance(doc, str) else doc.text for doc in docs)


def content_hash(texts: Sequence[str], *extra: str) -> str:
    """sha256 hex of the texts and the extra strings; length-prefixed, so no two inputs collide by concatenation."""
    digest = hashlib.sha256()
    for kind, items in ((b"T", texts), (b"X", extra)):
        for item in items:
            data = item.encode("utf-8", "surrogatepass")
            digest.update(kind + len(data).to_bytes(8, "little") + data)
    return digest.hexdigest()
