"""qkv.train.tasks: each task turns its preset into a run that passes check_run and does its job."""
import pytest

from qkv import presets
from qkv.train.checks import check_run
from qkv.data.genres import LABELS
from qkv.train.tasks import TASKS


@pytest.mark.parametrize("name", TASKS.names())
def test_every_task_turns_its_preset_into_a_valid_run(name):
    task = TASKS.get(name)
    cfg = task.apply(presets.get(task.preset))
    assert check_run(cfg) is cfg and task.summary and "\n" not in task.summary


def test_classify_is_a_three_way_head_on_the_genre_split():
    cfg = TASKS.get("classify").apply(presets.get("bert-shakespeare"))
    assert (cfg.model.arch, cfg.model.head, cfg.model.n_classes, cfg.model.labels) == ("encoder", "classifier", 3, LABELS)
    assert cfg.train.objective == "classify" and cfg.data.split == "genre" and cfg.train.max_time == 180.0


def test_classify_fine_tunes_with_adamw_whatever_the_pretraining_optimizer():
    cfg = TASKS.get("classify").apply(presets.get("bert-shakespeare"))
    assert presets.get("bert-shakespeare").train.optimizer == "muon"
    assert (cfg.train.optimizer, cfg.train.schedule, cfg.train.lr) == ("adamw", "cosine", 5e-4)
