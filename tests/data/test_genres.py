"""The genre set (qkv.data.genres): the First Folio's table, front matter cut, the stratified split by whole
works, and passages that never cross a work, drawn uniformly over window starts."""
import random
from collections import Counter

import numpy as np
import pytest

from qkv.data import genres
from qkv.data.corpus import bundled_documents
from qkv.errors import QkvError


def test_every_bundled_work_is_labelled_or_listed_as_unlabelled():
    """The Folio's catalogue: 14 comedies, 10 histories, 12 tragedies (Troilus with the tragedies);
    Pericles and the five poems have no label."""
    modern = {doc.id for doc in bundled_documents("modern")}
    assert modern == set(genres.GENRE_OF) | set(genres.UNLABELLED)
    assert not set(genres.GENRE_OF) & set(genres.UNLABELLED)
    assert Counter(genres.GENRE_OF.values()) == {"comedy": 14, "history": 10, "tragedy": 12}
    assert genres.GENRE_OF["troilus_and_cressida_gut"] == genres.GENRE_OF["cymbeline_gut"] == "tragedy"
    assert genres.GENRE_OF["winters_tale_gut"] == "comedy" and genres.GENRE_OF["henry_viii_gut"] == "history"


def test_play_text_drops_the_title_and_the_persons():
    docs = {doc.id: doc for doc in bundled_documents("modern")}
    naming_a_genre = 0
    for work in genres.labelled_works():
        title_line = docs[work.id].text.splitlines()[0]  # e.g. "THE TRAGEDY OF TITUS ANDRONICUS"
        assert docs[work.id].text.endswith(work.text) and work.text.lower().startswith("act"), work.id
        assert "DRAMATIS PERSONAE" not in work.text and "PERSONS REPRESENTED" not in work.text
        if any(genre in title_line for genre in ("TRAGEDY", "COMEDY", "HISTORY")):
            naming_a_genre += 1
            assert title_line not in work.text, work.id
    assert naming_a_genre >= 3
    with pytest.raises(QkvError, match="no act heading"):
        genres.play_text(docs["sonnets_gut"])


def test_split_is_by_whole_works_stratified_and_deterministic():
    works = genres.labelled_works()
    train, val, test = genres.split_works(works)
    ids = [{w.id for w in part} for part in (train, val, test)]
    assert not (ids[0] & ids[1] or ids[0] & ids[2] or ids[1] & ids[2])
    assert ids[0] | ids[1] | ids[2] == {w.id for w in works}
    for part, per_label in ((val, genres.VAL_PER_GENRE), (test, genres.TEST_PER_GENRE)):
        assert Counter(w.label for w in part) == {label: per_label for label in range(3)}
    shuffled = works[:]
    random.Random(0).shuffle(shuffled)  # the split depends on the ids only, not on the order given
    assert [{w.id for w in part} for part in genres.split_works(shuffled)] == ids
    with pytest.raises(QkvError, match="need 5"):
        genres.split_works([w for w in works if w.label != 1] + [w for w in works if w.label == 1][:4])


def test_genre_split_keeps_held_out_plays_out_of_pretraining():
    train_docs, val_docs = genres.genre_documents("modern")
    _, val, test = genres.bundled_split()
    assert {d.id for d in val_docs} == {w.id for w in val}
    assert not {d.id for d in train_docs} & {w.id for w in val + test}
    assert {"sonnets_gut", "pericles_gut"} <= {d.id for d in train_docs}  # unlabelled text may pretrain
    with pytest.raises(QkvError, match="modern"):
        genres.genre_documents("first-folio")


def fixture_passages(lengths=(50, 7, 23), labels=(2, 0, 1)) -> genres.Passages:
    """Work w's tokens are all 100 * (w + 1) + position: a window shows which work it came from."""
    ids = [100 * (w + 1) + np.arange(n) for w, n in enumerate(lengths)]
    return genres.Passages(ids, list(labels), ["a", "b", "c"], ("x", "y", "z"))


def test_windows_are_non_overlapping_inside_each_work():
    passages = fixture_passages()
    ids, labels, works = passages.windows(10)
    assert len(passages) == 80
    assert works.tolist() == [0] * 5 + [2] * 2  # 50 // 10 and 23 // 10; the 7-token work gives none
    assert labels.tolist() == [2] * 5 + [1] * 2
    assert np.array_equal(ids[:, 0] % 100, [0, 10, 20, 30, 40, 0, 10]) and (np.diff(ids, axis=1) == 1).all()


def test_training_windows_stay_in_one_work_and_are_uniform_over_starts():
    passages, T = fixture_passages(), 10
    sampler = genres.PassageBatches(passages, T, batch_size=64, seed=3)
    counts = Counter()
    for _ in range(100):
        ids, labels = sampler.next()
        work = ids[:, 0] // 100 - 1
        assert (np.diff(ids, axis=1) == 1).all() and (ids[:, -1] // 100 - 1 == work).all()  # one work
        assert np.array_equal(labels, np.asarray([2, 0, 1])[work])
        counts.update((ids[:, 0] % 100 + 100 * work).tolist())
    starts = 50 - T + 1 + 23 - T + 1  # 41 + 14 window starts, each expected 6400 / 55 times
    expected = 6400 / starts
    chi2 = sum((counts[k] - expected) ** 2 / expected for k in counts)
    assert len(counts) == starts and chi2 < starts + 5 * np.sqrt(2 * starts)  # 54 dof: mean 54, sd 10.4


def test_training_windows_resume_from_their_json_state():
    a = genres.PassageBatches(fixture_passages(), 10, 4, seed=1)
    a.next()
    b = genres.PassageBatches(fixture_passages(), 10, 4, seed=99)
    b.load_state(a.state())
    assert all(np.array_equal(x, y) for x, y in zip(a.next(), b.next()))
    with pytest.raises(QkvError, match="seq_len"):
        genres.PassageBatches(fixture_passages(), 11, 4, seed=1).load_state(a.state())
    with pytest.raises(QkvError, match="no work has 60 tokens"):
        genres.PassageBatches(fixture_passages(), 60, 4, seed=1)


def test_config_fields_of_the_task_are_validated():
    from qkv.train.checks import check_run
    from qkv.config import DataConfig, ModelConfig, RunConfig

    with pytest.raises(QkvError, match="data.split='nope' is not allowed; choose from: .*genre.*standard"):
        check_run(RunConfig(data=DataConfig(split="nope")))
    with pytest.raises(QkvError, match="model.labels has 2 names, model.n_classes=3"):
        ModelConfig(arch="encoder", head="classifier", n_classes=3, labels=("a", "b")).validate()
    assert ModelConfig(arch="encoder", head="classifier", n_classes=3, labels=genres.LABELS).validate()
