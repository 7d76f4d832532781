"""The CLI's one error boundary: a closed pipe ends quietly, a full disk or deep JSON is one `qkv: error:` line
(exit 2, no traceback), and a checkpoint that cannot be written leaves no .staging behind."""
import errno
import subprocess
import sys

import pytest
import torch

from qkv.errors import QkvError
from qkv.train import checkpoint
from tests.serve.live import write_run


def sh(command: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    return write_run(tmp_path_factory.mktemp("boundary") / "tiny")


def test_a_closed_pipe_ends_quietly(run_dir):
    proc = sh(f"{sys.executable} -m qkv generate {run_dir} --prompt the --strategy greedy --stream "
              f"--max-new-tokens 60 | head -c1; exit ${{PIPESTATUS[0]}}")
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    assert len(proc.stdout) == 1


def test_a_full_disk_for_the_output_is_one_error_line():
    proc = sh(f"{sys.executable} -m qkv presets > /dev/full")
    assert proc.returncode == 2 and proc.stderr.startswith("qkv: error: ") and proc.stderr.count("\n") == 1
    assert "No space left on device" in proc.stderr and "Traceback" not in proc.stderr


def test_json_nested_too_deeply_is_one_error_line(tmp_path):
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 100000 + "]" * 100000)
    proc = sh(f"{sys.executable} -m qkv train --config {deep} --out {tmp_path / 'out'}")
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "nested too deeply" in proc.stderr


def test_a_checkpoint_that_cannot_be_written_leaves_the_old_one_and_no_staging(tmp_path, monkeypatch):
    model = torch.nn.Linear(3, 3)
    checkpoint.save(tmp_path, model, {}, {"step": 1})
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}

    def full_disk(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(checkpoint, "save_file", full_disk)
    with pytest.raises(OSError, match="No space"):
        checkpoint.save(tmp_path, model, {}, {"step": 2})
    from safetensors import SafetensorError

    def safetensors_fails(*args, **kwargs):
        raise SafetensorError("Error while serializing: IoError(No space left on device)")

    monkeypatch.setattr(checkpoint, "save_file", safetensors_fails)
    with pytest.raises(QkvError, match="cannot write the checkpoint"):
        checkpoint.save(tmp_path, model, {}, {"step": 2})
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before  # no .staging, the old set intact


def test_a_warning_is_one_qkv_line(run_dir):
    proc = sh(f"{sys.executable} -m qkv generate {run_dir} --prompt '{'word ' * 200}' --strategy greedy "
              f"--max-new-tokens 4")
    assert proc.returncode == 0
    assert proc.stderr.startswith("qkv: warning: model.max_seq_len=64: prompt of") and proc.stderr.count("\n") == 1


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    out = tmp_path_factory.mktemp("trained") / "run"
    proc = sh(f"{sys.executable} -m qkv train --preset tiny --max-steps 3 --out {out} --quiet --no-sample")
    assert proc.returncode == 0, proc.stderr
    return out


def test_plot_names_the_file_it_wrote_and_refuses_garbage_metrics(trained, tmp_path):
    proc = sh(f"{sys.executable} -m qkv plot loss {trained} --out {tmp_path / 'curve'}")
    assert proc.returncode == 0 and proc.stdout.strip() == str(tmp_path / "curve.png")
    assert (tmp_path / "curve.png").is_file()
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "metrics.csv").write_text("step,loss\nx,y\n")
    proc = sh(f"{sys.executable} -m qkv plot loss {broken} --out {tmp_path / 'b.png'}")
    assert proc.returncode == 2 and "row 1: step='x' is not a number" in proc.stderr and proc.stderr.count("\n") == 1
    proc = sh(f"{sys.executable} -m qkv plot loss {trained} --out {tmp_path / 'c.xyz'}")
    assert proc.returncode == 2 and "not supported" in proc.stderr and proc.stderr.count("\n") == 1


def test_a_resume_without_the_runs_tokenizer_is_refused(trained, tmp_path):
    import shutil

    run = tmp_path / "run"
    shutil.copytree(trained, run)
    (run / "tokenizer.json").unlink()
    before = {p.name: p.read_bytes() for p in run.iterdir() if p.name != ".lock"}
    proc = sh(f"{sys.executable} -m qkv train --out {run} --resume --max-steps 5 --quiet --no-sample")
    assert proc.returncode == 2 and "tokenizer.json: missing" in proc.stderr and proc.stderr.count("\n") == 1
    assert {p.name: p.read_bytes() for p in run.iterdir() if p.name != ".lock"} == before


def test_a_conversion_that_cannot_write_leaves_nothing(tmp_path, monkeypatch):
    from safetensors import SafetensorError

    from qkv.formats.hf import files as hf_files

    def full_disk(*args, **kwargs):
        raise SafetensorError("Error while serializing: IoError(No space left on device)")

    monkeypatch.setattr(hf_files, "save_file", full_disk)
    with pytest.raises(QkvError, match="cannot write model.safetensors"):
        hf_files.write_dir(tmp_path / "out", {"config.json": "{}"}, {"w": torch.zeros(2)})
    assert list(tmp_path.iterdir()) == []  # neither the dir nor its temporary sibling
