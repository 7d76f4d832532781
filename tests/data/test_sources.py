"""qkv.data.sources: a DataConfig's (train, validation) documents: the bundled corpus by its split (whole
works held out, disjoint), or the user's files by fraction; every split name is a registry entry."""
import pytest

from qkv.config import DataConfig
from qkv.data import sources
from qkv.data.corpus import VALIDATION_WORKS


def test_standard_split_holds_out_the_validation_works_and_nothing_else():
    from qkv.data.corpus import bundled_documents

    train, val = sources.split(DataConfig())
    assert {d.id for d in val} == set(VALIDATION_WORKS)
    assert not {d.id for d in train} & {d.id for d in val}
    assert {d.id for d in train} | {d.id for d in val} == {d.id for d in bundled_documents("modern")}


def test_the_genre_split_keeps_its_validation_and_test_plays_out_of_training():
    from qkv.data.genres import bundled_split, held_out_ids

    train, val = sources.split(DataConfig(split="genre"))
    _, validation, test = bundled_split()
    assert not {d.id for d in train} & held_out_ids()
    assert {w.id for w in validation} | {w.id for w in test} <= held_out_ids()
    assert {d.id for d in val} == {w.id for w in validation}


def test_user_files_split_by_fraction_of_whole_documents(tmp_path):
    for i in range(4):
        (tmp_path / f"{i}.txt").write_text(f"document {i} " * 50)
    train, val = sources.split(DataConfig(paths=(str(tmp_path),), val_fraction=0.25))
    assert [d.id for d in val] == [str(tmp_path / "3.txt")] and len(train) == 3


@pytest.mark.parametrize("name", sources.SPLITS.names())
def test_every_split_is_a_registry_entry_that_returns_two_lists(name):
    train, val = sources.SPLITS.get(name)("modern")
    assert train and val and isinstance(train, list) and isinstance(val, list)
