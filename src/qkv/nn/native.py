"""Loops written in C for this machine: a C file shipped beside qkv's modules, built on first use by the
machine's own C compiler (`cc`, or $CC) for this CPU (-march=native) with OpenMP, kept in ~/.cache/qkv/native
under a name that hashes the source, the flags, the compiler and the CPU, and called through ctypes (which lets
go of the GIL for the call). The build takes about a second; a later start loads the kept library.

Where no compiler answers, or the build fails, `library()` says None and the caller keeps torch's kernels: a
build is an optimisation, never a requirement. QKV_NATIVE=0 turns every such library off. Nothing is
downloaded: the source is qkv's own (qkv/nn/*.c).
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import threading
from pathlib import Path

from qkv import hardware

FLAG_SETS = (("-O3", "-march=native", "-fopenmp"), ("-O3", "-march=native"), ("-O3",))  # tried in turn
_lock = threading.Lock()
_built: dict[str, ctypes.CDLL | None] = {}


def compiler() -> str | None:
    """The C compiler to build with: $CC, else cc, gcc or clang on PATH; None where there is none."""
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def library(name: str) -> ctypes.CDLL | None:
    """qkv/nn/<name>.c built for this machine and loaded (once a process), or None where it cannot be."""
    with _lock:
        if name not in _built:
            _built[name] = None if os.environ.get("QKV_NATIVE") == "0" else build(name)
        return _built[name]


def build(name: str) -> ctypes.CDLL | None:
    source = Path(__file__).with_name(f"{name}.c")
    cc = compiler()
    if cc is None or not source.is_file():
        return None
    text = source.read_bytes()
    for flags in FLAG_SETS:
        key = hashlib.sha256(b"\0".join([text, " ".join(flags).encode(), cc.encode(),
                                         (hardware.cpu_model() or "").encode()])).hexdigest()[:16]
        path = Path.home() / ".cache" / "qkv" / "native" / f"{name}-{key}.so"
        if not path.is_file():
            tmp = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                done = subprocess.run([cc, *flags, "-shared", "-fPIC", str(source), "-o", str(tmp)],
                                      capture_output=True, timeout=120)
                if done.returncode != 0:
                    tmp.unlink(missing_ok=True)
                    continue
                os.replace(tmp, path)
            except (OSError, subprocess.SubprocessError):
                tmp.unlink(missing_ok=True)
                continue
        try:
            return ctypes.CDLL(str(path))
        except OSError:
            continue
    return None
