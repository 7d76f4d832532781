"""One writer per run dir: a second `qkv train` on a run being written exits 2 naming the writer's pid, and
a writer killed with SIGKILL leaves no stale lock (the kernel drops a flock with its process)."""
import os
import subprocess
import sys
import time

import pytest

from qkv import files
from qkv.errors import QkvError


def test_a_second_lock_on_the_same_dir_is_refused_with_the_holders_pid(tmp_path):
    first = files.RunLock(tmp_path).acquire()
    with pytest.raises(QkvError, match=f"pid {os.getpid()}"):
        files.RunLock(tmp_path).acquire()
    first.release()
    with files.RunLock(tmp_path):  # free again once released
        assert (tmp_path / files.LOCK_FILE).read_text().strip() == str(os.getpid())


def test_a_holder_that_has_not_yet_written_its_pid_is_still_named(tmp_path):
    """The holder takes the flock, then writes its pid: a writer refused in between waits for the pid
    instead of naming "pid unknown"."""
    import fcntl
    import threading

    fd = os.open(tmp_path / files.LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # locked, still empty
    late = threading.Timer(0.2, lambda: os.pwrite(fd, b"4242\n", 0))
    late.start()
    try:
        with pytest.raises(QkvError, match="pid 4242"):
            files.RunLock(tmp_path).acquire()
    finally:
        late.join()
        os.close(fd)


def qkv(*args, **kwargs):
    return subprocess.Popen([sys.executable, "-m", "qkv", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, **kwargs)


def wait_for_lock(path, pid, timeout=60):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (path / files.LOCK_FILE).is_file() and (path / files.LOCK_FILE).read_text().strip() == str(pid):
            return
        time.sleep(0.05)
    raise AssertionError("the first writer never took the lock")


def test_two_writers_on_one_run_dir_and_a_killed_writer_leaves_no_stale_lock(tmp_path):
    """Two `qkv train --out DIR` started together: one writes the run, the other exits 2 at once (the
    holder's pid, or "already exists" if it looked after the first had written); the config is the one
    writer's. A `--resume` meanwhile exits 2 naming the writer. After kill -9 the run resumes."""
    out = tmp_path / "run"
    args = ["train", "--preset", "tiny", "--max-steps", "100000", "--out", str(out), "--quiet", "--no-sample",
            "--set", "train.checkpoint_every=20"]
    writers = {seed: qkv(*args, "--set", f"train.seed={seed}") for seed in (11, 12)}
    try:
        deadline = time.monotonic() + 120
        while all(w.poll() is None for w in writers.values()):
            assert time.monotonic() < deadline, "neither writer was refused"
            time.sleep(0.05)
        (lost_seed, loser), = [(seed, w) for seed, w in writers.items() if w.poll() is not None]
        (seed, writer), = [(s, w) for s, w in writers.items() if w is not loser]
        err = loser.stderr.read()
        assert loser.returncode == 2 and err.startswith("qkv: error: ") and err.count("\n") == 1, err
        assert f"pid {writer.pid}" in err or "already exists" in err
        wait_for_lock(out, writer.pid)
        second = qkv("train", "--out", str(out), "--resume", "--max-steps", "5")
        _, err = second.communicate(timeout=120)
        assert second.returncode == 2 and f"pid {writer.pid}" in err and err.count("\n") == 1, err
        while not files.has_checkpoint(out):  # let it save once, then kill it at an arbitrary moment
            assert time.monotonic() < deadline and writer.poll() is None
            time.sleep(0.1)
        assert files.read_json(out / files.CONFIG_FILE)["train"]["seed"] == seed != lost_seed
    finally:
        for w in writers.values():
            w.kill()
            w.wait()
    resumed = qkv("train", "--out", str(out), "--resume", "--max-steps", "1", "--quiet", "--no-sample")
    _, err = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, err


def test_a_new_run_that_fails_before_writing_leaves_no_dir(tmp_path):
    out = tmp_path / "never"
    proc = qkv("train", "--preset", "tiny", "--out", str(out), "--set", "model.n_heads=3")
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 2 and err.startswith("qkv: error: ")
    assert not out.exists()
