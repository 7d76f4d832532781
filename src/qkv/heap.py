"""glibc's heap and the memory it returns to the system: what a model's resident memory is made of besides its
tensors (docs/real-models.md). Elsewhere (another C library) nothing here changes anything."""
from __future__ import annotations

import ctypes
import ctypes.util
import functools
from contextlib import contextmanager
from typing import Iterator


M_MMAP_THRESHOLD = -3  # mallopt's parameter (glibc malloc.h)
LOADING_MMAP_THRESHOLD = 128 * 1024  # glibc's initial threshold: blocks above it mapped, unmapped when freed
STEADY_MMAP_THRESHOLD = 32 * 1024 * 1024  # the ceiling glibc's own adjustment reaches on 64-bit


@contextmanager
def freed_buffers_returned() -> Iterator[None]:
    """While a model is read and converted, every buffer above 128 KiB is mapped on its own and returned to the
    system when freed (glibc's mallopt; elsewhere nothing changes). glibc otherwise raises that threshold to
    the size of the first big buffer freed, so the fp32 weights each block is read into before quantizing,
    freed one after another, stay in the heap, which only grows: `qkv chat SmolLM2... --quant int8` peaked at
    0.96-1.13 GB of resident memory that way, 0.72 GB this way (docs/real-models.md). Afterwards the threshold
    is set to the ceiling that adjustment reaches, as if it had run."""
    libc = glibc()
    if libc is None:
        yield
        return
    libc.mallopt(M_MMAP_THRESHOLD, LOADING_MMAP_THRESHOLD)
    try:
        yield
    finally:
        libc.mallopt(M_MMAP_THRESHOLD, STEADY_MMAP_THRESHOLD)
        libc.malloc_trim(0)


@functools.cache
def glibc():
    """The C library when it is glibc (mallopt, malloc_trim), else None."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
        return libc if hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None
    except OSError:
        return None


def return_freed() -> None:
    """Give the heap's free pages back to the system (malloc_trim): after a burst of small allocations freed
    together (the tokenizers library parsing Gemma 3's 514,906 merges leaves 290 MB of them), which glibc
    would otherwise keep for later ones."""
    libc = glibc()
    if libc is not None:
        libc.malloc_trim(0)
