"""Shared helpers for the training and CLI tests: a few KB of made-up verse and one cached tiny run.

Everything here keeps the tests fast on a shared two-core machine: the `tiny` preset, a 280-token
vocabulary, one torch thread, and a token cache in a temporary folder (QKV_CACHE), never the bundled corpus.
"""
from __future__ import annotations

import random
from pathlib import Path

import torch

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
    """QKV_CACHE in the session's temporary folder and one torch thread (two threads on a busy two-core
    machine make the tiny model ~50x slower); returns the verse file."""
    monkeypatch.setenv("QKV_CACHE", str(shared_dir(tmp_path_factory, "cache")))
    torch.set_num_threads(1)
    path = shared_dir(tmp_path_factory, "text") / "verse.txt"
    if not path.exists():
        path.write_text(verse(), encoding="utf-8")
    return path


def trained_run(tmp_path_factory) -> Path:
    """A tiny run trained once per session through the CLI (12 steps); tests must not modify it."""
    run = shared_dir(tmp_path_factory, "runs") / "tiny"
    if not run.exists():
        from qkv.cli import main

        text = shared_dir(tmp_path_factory, "text") / "verse.txt"
        rc = main(["train", *TINY, "--data", str(text), "--out", str(run), "--max-steps", "12",
                   "--set", "train.log_every=1", "--no-sample", "--json"])
        assert rc == 0
    return run
