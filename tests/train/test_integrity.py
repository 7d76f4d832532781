"""A checkpoint is a complete, recorded set: `qkv train --resume` refuses (exit 2, one line, nothing touched)
a set with a file missing, altered, mis-shaped or malformed, and a diverged run never replaces a finite
checkpoint. Oracle: the files' bytes before and after each refusal; the set's own record."""
import json
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import save_file

from qkv import files
from qkv.cli import main
from qkv.errors import QkvError
from qkv.train import checkpoint, checks
from qkv.config import RunConfig
from qkv.parallel.layout import Layout
from qkv.train.steps import MicroBatches


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    out = tmp_path_factory.mktemp("integrity") / "run"
    proc = run_qkv("train", "--preset", "tiny", "--max-steps", "4", "--out", str(out), "--quiet", "--no-sample")
    assert proc.returncode == 0, proc.stderr
    return out


def run_qkv(*args):
    return subprocess.run([sys.executable, "-m", "qkv", *args], capture_output=True, text=True, timeout=300)


def snapshot(folder):
    return {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file() and p.name != files.LOCK_FILE}


def edit_state(run, change):
    """Edit train_state.json by hand as a user could (the record would give the edit away: it goes too)."""
    (run / files.RECORD_FILE).unlink()
    raw = json.loads((run / files.STATE_JSON).read_text())
    change(raw)
    (run / files.STATE_JSON).write_text(json.dumps(raw))


def edit_tensors(run, change):
    (run / files.RECORD_FILE).unlink()
    tensors = files.read_tensors(run / files.STATE_TENSORS)
    save_file(change(tensors), str(run / files.STATE_TENSORS))


def flip_a_byte(run):
    data = bytearray((run / files.MODEL_FILE).read_bytes())
    data[-3] ^= 0xFF
    (run / files.MODEL_FILE).write_bytes(bytes(data))


def first_moment(tensors):
    return next(name for name in tensors if name.endswith("exp_avg"))


CASES = {
    "model missing": (lambda run: (run / files.MODEL_FILE).unlink(), "model.safetensors is missing"),
    "state json missing": (lambda run: (run / files.STATE_JSON).unlink(), "train_state.json is missing"),
    "state tensors missing": (lambda run: (run / files.STATE_TENSORS).unlink(), "train_state.safetensors is missing"),
    "old-style set missing a file": (lambda run: [(run / n).unlink() for n in (files.RECORD_FILE, files.STATE_JSON)],
                                     "incomplete: train_state.json missing"),
    "weights altered": (flip_a_byte, "differs from the checkpoint record"),
    "record garbage": (lambda run: (run / files.RECORD_FILE).write_text("[1, 2]"), "not a checkpoint record"),
    "negative step": (lambda run: edit_state(run, lambda raw: raw.update(step=-1)), "step=-1 is negative"),
    "step not an integer": (lambda run: edit_state(run, lambda raw: raw.update(step="4")),
                            "'step' must be an integer"),
    "no trainer": (lambda run: edit_state(run, lambda raw: raw.pop("trainer")), "'trainer' must be"),
    "trainer field of the wrong type": (lambda run: edit_state(run, lambda raw: raw["trainer"].update(tokens="many")),
                                        "trainer.tokens must be int"),
    "unknown trainer field": (lambda run: edit_state(run, lambda raw: raw["trainer"].update(surprise=1)),
                              "unknown trainer field"),
    "steps disagree": (lambda run: edit_state(run, lambda raw: raw["trainer"].update(step=3)), "differs from step"),
    "bad data position": (lambda run: edit_state(run, lambda raw: raw["trainer"].update(batches={"x": []})),
                          "data state is for"),
    "mis-shaped moment": (lambda run: edit_tensors(run, lambda t: {**t, first_moment(t): t[first_moment(t)][..., :1].contiguous()}),
                          "has shape"),
    "no moments": (lambda run: edit_tensors(run, lambda t: {k: v for k, v in t.items() if not k.startswith("optim.")}),
                   "no optimizer state"),
    "nan moment": (lambda run: edit_tensors(run, lambda t: {**t, first_moment(t): t[first_moment(t)] * float("nan")}),
                   "non-finite"),
    "moment of no parameter": (lambda run: edit_tensors(run, lambda t: {**t, "optim.999.exp_avg": torch.zeros(1)}),
                               "names no parameter"),
}


@pytest.mark.parametrize("case", CASES)
def test_resume_refuses_a_damaged_checkpoint_and_touches_nothing(trained, tmp_path, capsys, case):
    """Each case through qkv's entry point in this process (`main`, as `python -m qkv` calls it: the exit code
    and stderr it gives); the first also as a process of its own, where the interpreter's exit says the same."""
    damage, message = CASES[case]
    run = tmp_path / "run"
    shutil.copytree(trained, run)
    damage(run)
    before = snapshot(run)
    argv = ("train", "--out", str(run), "--resume", "--max-steps", "6", "--quiet", "--no-sample")
    if case == next(iter(CASES)):
        proc = run_qkv(*argv)
        rc, err = proc.returncode, proc.stderr
    else:
        rc, err = main(list(argv)), capsys.readouterr().err
    assert rc == 2, err
    assert err.startswith("qkv: error: ") and err.count("\n") == 1, err
    assert message in err
    assert snapshot(run) == before


def test_an_intact_set_resumes_and_a_weights_only_dir_fine_tunes(trained, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(trained, run)
    proc = run_qkv("train", "--out", str(run), "--resume", "--max-steps", "6", "--quiet", "--no-sample", "--json")
    assert proc.returncode == 0 and "resuming from the checkpoint at step 4" in proc.stderr, proc.stderr
    assert json.loads(proc.stdout)["steps"] == 6 and checkpoint.verify_set(run) == "complete"
    imported = tmp_path / "imported"  # as `qkv convert` leaves a run: config, tokenizer, weights
    imported.mkdir()
    for name in (files.CONFIG_FILE, files.TOKENIZER_FILE, files.MODEL_FILE):
        shutil.copy(trained / name, imported / name)
    proc = run_qkv("train", "--out", str(imported), "--resume", "--max-steps", "2", "--quiet", "--no-sample")
    assert proc.returncode == 0 and "fine-tuning them from step 0" in proc.stderr, proc.stderr


def test_integer_weights_are_refused_not_cast(trained, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(trained, run)
    tensors = files.read_tensors(run / files.MODEL_FILE)
    name = next(iter(tensors))
    save_file({**tensors, name: tensors[name].to(torch.int32)}, str(run / files.MODEL_FILE))
    proc = run_qkv("generate", str(run), "--prompt", "a", "--max-new-tokens", "2")
    assert proc.returncode == 2 and f"{name} is stored as int32" in proc.stderr


class Batches:
    def state(self):
        return {}


def test_a_diverged_model_never_replaces_a_finite_checkpoint(tmp_path):
    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.AdamW(model.parameters())
    saver = checkpoint.Checkpoints(model, optimizer, torch.amp.GradScaler("cpu", enabled=False), Batches(),
                                   Layout(), MicroBatches(model, RunConfig(), Layout()), log=print)
    saver.save(tmp_path, checkpoint.State(step=1))
    before = snapshot(tmp_path)
    with torch.no_grad():
        model.weight[0, 0] = float("inf")
    with pytest.raises(QkvError, match="weight is not finite; the checkpoint on disk was kept"):
        saver.save(tmp_path, checkpoint.State(step=2))
    assert snapshot(tmp_path) == before and checkpoint.verify_set(tmp_path) == "complete"


@pytest.mark.parametrize("setting", ["train.lr=inf", "train.weight_decay=nan", "model.init_std=inf",
                                     "model.n_layers=100000000000000000000", "data.vocab_size=1000000000",
                                     "model.d_model=100000000"])
def test_impossible_settings_are_refused_before_any_work(tmp_path, capsys, setting):
    """Through `main` in this process (the damaged-checkpoint test runs one such refusal as a process)."""
    rc = main(["train", "--preset", "tiny", "--out", str(tmp_path / "r"), "--set", setting])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("qkv: error: ") and err.count("\n") == 1, err
    assert not (tmp_path / "r").exists()


def test_the_memory_check_is_qkv_calcs_figure(monkeypatch):
    """Refused exactly when `qkv calc`'s per-process total for the run exceeds the machine's memory."""
    from qkv import presets
    import dataclasses

    from qkv.analysis import calc

    cfg = presets.get("shakespeare")  # the trained tokenizer's size is the model's: data.vocab_size
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, vocab_size=cfg.data.vocab_size))
    total = calc.calculate(cfg)["memory"]["bytes"]["total"]
    monkeypatch.setattr(checks, "machine_memory", lambda: int(total) + 1)
    checks.check_fits(cfg)
    monkeypatch.setattr(checks, "machine_memory", lambda: int(total) - 1)
    with pytest.raises(QkvError, match=f"{total / 2 ** 30:,.1f} GiB per process by `qkv calc`"):
        checks.check_fits(cfg)
