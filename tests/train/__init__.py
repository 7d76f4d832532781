"""Shared helpers for the training and CLI tests: a few KB of made-up verse and one cached tiny run.

Everything here keeps the tests fast on a shared two-core machine: the `tiny` preset, a 280-token
vocabulary, one torch thread, and a token cache in a temporary folder (QKV_CACHE), never the bundled corpus.
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import torch.distributed as dist

WORDS = ("moon sea night doth sing upon silver wind where golden crowns lie sleeping under stars love "
         "heart shall fade while summer breathes gentle rain thou art more fair than morning light "
         "and all the river runs to meet her").split()

# the CLI arguments every fast training run shares
TINY = ["--preset", "tiny", "--set", "data.vocab_size=280", "--set", "train.threads=1", "--quiet"]


def verse(lines: int = 40, repeats: int = 3, seed: int = 0) -> str:
    """`lines` lines of made-up verse, repeated `repeats` times with a word changed here and there."""
    rng = random.Random(seed)
    stanza = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 9))).capitalize() + rng.choice(",.;!")
              for _ in range(lines)]
    out = []
    for _ in range(repeats):
        for line in stanza:
            words = line.split()
            words[rng.randrange(len(words))] = rng.choice(WORDS)
            out.append(" ".join(words))
    return "\n".join(out) + "\n"


_SHARED: dict[str, Path] = {}


def shared_dir(tmp_path_factory, name: str) -> Path:
    """One folder per test session (the token cache, the verse file, a trained run)."""
    if name not in _SHARED:
        _SHARED[name] = tmp_path_factory.mktemp(name)
    return _SHARED[name]


def setup_env(monkeypatch, tmp_path_factory) -> Path:
    """QKV_CACHE in the session's temporary folder (tests/conftest.py already sets one torch thread);
    returns the verse file."""
    monkeypatch.setenv("QKV_CACHE", str(shared_dir(tmp_path_factory, "cache")))
    path = shared_dir(tmp_path_factory, "text") / "verse.txt"
    if not path.exists():
        path.write_text(verse(), encoding="utf-8")
    return path


def trained_run(tmp_path_factory) -> tuple[Path, dict]:
    """A tiny run trained once per session through the CLI (12 steps) and its --json summary.
    Tests must not modify it."""
    run = shared_dir(tmp_path_factory, "runs") / "tiny"
    if run.name not in _SUMMARIES:
        from qkv.cli import main

        text = shared_dir(tmp_path_factory, "text") / "verse.txt"
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            rc = main(["train", *TINY, "--data", str(text), "--out", str(run), "--max-steps", "12",
                       "--set", "train.log_every=1", "--no-sample", "--json"])
        assert rc == 0, err.getvalue()
        _SUMMARIES[run.name] = json.loads(out.getvalue())
    return run, _SUMMARIES[run.name]


_SUMMARIES: dict[str, dict] = {}


REPO = Path(__file__).resolve().parents[2]


def held_store():
    """A rendezvous store this process holds for ranks it starts (their environment: store_env): the port
    stays bound from the start, where a port probed free and closed could be taken by another test's process
    before the ranks bind it (gloo's own listeners take such ports)."""
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)


def store_env(store) -> dict[str, str]:
    """The variables that make `init_process_group` on env:// connect every rank to `store` as a client (as
    torchrun's ranks connect to their agent's store)."""
    return {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store.port), "TORCHELASTIC_USE_AGENT_STORE": "True"}


def reserved_port() -> int:
    """A free port below the system's ephemeral range (which bind(0) never hands out, so neither another
    test's gloo listener nor its probe takes it between this probe and the launch); any free port where the
    range leaves none below it."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 0
    candidates = random.sample(range(10000, low), min(50, low - 10000)) if low > 11000 else []
    for port in [*candidates, 0]:
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
            return probe.getsockname()[1]
    raise RuntimeError("no free port")


def launch_env() -> dict[str, str]:
    """The environment of a launched process: one torch thread, the tests package importable."""
    return {**os.environ, "OMP_NUM_THREADS": "1",
            "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}


def benchmark_folder(prefix: str) -> tuple[Path, Path, dict[str, str]]:
    """A benchmark's temporary folder, its verse file (200 lines) and the environment of the ranks it launches:
    launch_env's, with this checkout's src importable and a token cache of their own in the folder."""
    out = Path(tempfile.mkdtemp(prefix=prefix))
    text = out / "verse.txt"
    text.write_text(verse(lines=200), encoding="utf-8")
    env = launch_env()
    return out, text, {**env, "QKV_CACHE": str(out / "cache"),
                       "PYTHONPATH": f"{REPO / 'src'}{os.pathsep}{env['PYTHONPATH']}"}


def torchrun(processes: int, args: list[str], timeout: int = 300) -> subprocess.CompletedProcess:
    """`torchrun --standalone --nproc-per-node processes <args>` from the repository root (args such as
    ["-m", "qkv", "train", ...]); every rank must exit 0."""
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                           str(processes), *args], cwd=REPO, env=launch_env(), capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, rank_errors(proc.stderr)
    return proc


def rank_errors(stderr: str) -> str:
    """The last lines each rank printed with its "[rankN]:" prefix, then the launcher's tail: torchrun names
    only the first rank it saw fail, and another rank's error can be long gone from the tail."""
    ranks: dict[str, list[str]] = {}
    for line in stderr.splitlines():
        if line.startswith("[rank") and "]:" in line:
            ranks.setdefault(line[:line.index("]:") + 2], []).append(line)
    return "\n".join([*(line for lines in ranks.values() for line in lines[-12:]), "...", stderr[-1500:]])
