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
