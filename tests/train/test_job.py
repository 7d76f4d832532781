"""`qkv train`'s setup as functions (qkv.train.job): the config's order of precedence, the limits, the
default run dir that overwrites nothing, the run-dir claim (nothing left behind by a failed start), the
memory check against `qkv calc`, and which fields a resume may change."""
import dataclasses
import os

import pytest

from qkv import presets
from qkv.config import RunConfig
from qkv.errors import QkvError
from qkv.files import CONFIG_FILE
from qkv.train import checks, job


def test_precedence_preset_then_file_then_set_then_flags(tmp_path):
    config = tmp_path / "c.json"
    config.write_text('{"train": {"lr": 0.5, "max_steps": 7}, "model": {"d_model": 48}}')
    cfg = job.resolve_config(preset="tiny", config_file=str(config), overrides=["train.lr=0.25"],
                             data=["corpus.txt"], max_steps=3, max_time=None)
    assert cfg.model.d_model == 48  # the file over the preset
    assert cfg.train.lr == 0.25  # --set over the file
    assert cfg.train.max_steps == 3 and cfg.train.max_time == 0.0  # --max-steps: a step budget, no clock
    assert cfg.data.paths == (os.path.abspath("corpus.txt"),)  # absolute: a resume elsewhere reads the same
    assert cfg.model.n_layers == presets.get("tiny").model.n_layers  # the rest is the preset's


def test_limits_combine():
    cfg = presets.get("shakespeare")
    assert job.with_limits(cfg, None, 60.0).train.max_time == 60.0
    both = job.with_limits(cfg, 100, 60.0).train
    assert (both.max_steps, both.max_time) == (100, 60.0)
    assert job.with_limits(cfg, None, None) == cfg


def test_default_out_never_names_an_existing_dir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert job.default_out("tiny") == tmp_path.joinpath("runs", "tiny").relative_to(tmp_path)
    (tmp_path / "runs" / "tiny").mkdir(parents=True)
    (tmp_path / "runs" / "tiny-2").mkdir()
    assert str(job.default_out("tiny")) == os.path.join("runs", "tiny-3")


def test_a_failed_new_run_leaves_no_dir_and_an_existing_one_is_refused(tmp_path):
    out = tmp_path / "run"
    with pytest.raises(RuntimeError):
        with job.claim(out, resume=False):
            assert out.is_dir()
            raise RuntimeError("failed before writing anything")
    assert not out.exists()
    out.mkdir()
    (out / CONFIG_FILE).write_text("{}")
    with pytest.raises(QkvError, match="already exists; pass --resume"):
        with job.claim(out, resume=False):
            pass
    assert (out / CONFIG_FILE).read_text() == "{}"  # untouched
    with pytest.raises(QkvError, match="nothing to resume"):
        with job.claim(tmp_path / "missing", resume=True):
            pass


def test_a_step_larger_than_the_machine_is_refused_by_the_calculator(monkeypatch):
    monkeypatch.setattr(checks, "machine_memory", lambda: 2 ** 30)  # a 1 GiB machine
    checks.check_fits(presets.get("tiny"))  # a few MiB: fits
    big = presets.get("tiny").override(["model.d_model=2048", "model.d_ff=8192", "train.batch_size=64",
                                        "train.seq_len=64"])
    with pytest.raises(QkvError, match="GiB per process by `qkv calc`"):
        checks.check_fits(big)


def test_a_resume_may_change_the_limits_and_layout_only(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    saved = presets.get("tiny")
    saved.save(out / CONFIG_FILE)
    cfg = job.resume_config(out, 50, None, ["parallel.dp=1"])
    assert cfg.train.max_steps == 50 and dataclasses.replace(cfg, train=saved.train) == saved
    with pytest.raises(QkvError, match="would change train.lr"):
        job.resume_config(out, None, None, ["train.lr=0.9"])
    assert RunConfig.load(out / CONFIG_FILE) == saved  # a refused resume changes nothing
    assert job.differences(saved, saved.override(["train.lr=0.9", "model.d_ff=80"])) == ["model.d_ff", "train.lr"]


def test_only_rank_zero_refuses_a_filled_run_dir(tmp_path, monkeypatch):
    """Under torchrun rank 0 writes a new run's config while another rank may still be starting (FSDP2's
    setup has no collective to wait at): that rank must not take the new run for an existing one."""
    out = tmp_path / "run"
    out.mkdir()
    RunConfig().save(out / CONFIG_FILE)
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(QkvError, match="already exists"):
        job.refuse_existing(out)
    monkeypatch.setenv("RANK", "1")
    job.refuse_existing(out)  # rank 0 has already decided
