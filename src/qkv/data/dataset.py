"""Token streams on disk (memmap), the tokenization cache, random training batches, eval windows."""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

try:
    import fcntl  # POSIX; elsewhere concurrent builders race harmlessly (the first complete entry wins)
except ImportError:  # pragma: no cover
    fcntl = None

import numpy as np

from qkv.data.corpus import JOINER, content_hash
from qkv.data.tokenizer import Tokenizer
from qkv.errors import QkvError

CACHE_VERSION = "1"  # bump when tokenization or the file layout changes
CHUNK_CHARS = 1 << 20

# A cut right after "\n" between two printable ASCII characters ("x\nY") is a boundary of the byte-level
# pre-tokenizer (GPT-2 regex): no pre-token joins a non-space to a following "\n", and only " " (never "\n")
# prefixes a word. Cuts inside whitespace runs are NOT safe: "x  \n" alone pre-tokenizes as "  \n",
# but in "x  \nY" as "  " + "\n". So BPE of the chunks equals BPE of the whole text.
_SAFE_CUT = re.compile(r"(?<=[!-~])\n(?=[!-~])")


def dtype_for(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)


def _write_atomic(path: str, data: bytes) -> None:
    tmp = path + ".tmp"
    with open(tmp, "wb") as handle:
        handle.write(data)
    os.replace(tmp, path)


def write_tokens(path: str | os.PathLike, ids: np.ndarray, vocab_size: int) -> None:
    """ids -> raw uint16/uint32 file at `path` + JSON sidecar `path.json` (dtype, length), both atomic."""
    path = os.fspath(path)
    ids = np.asarray(ids)
    if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
        raise ValueError(f"token ids must lie in [0, {vocab_size}), got [{ids.min()}, {ids.max()}]")
    dtype = dtype_for(vocab_size)
    _write_atomic(path, ids.astype(dtype).tobytes())
    meta = {"dtype": dtype.name, "length": int(ids.size), "vocab_size": vocab_size}
    _write_atomic(path + ".json", json.dumps(meta).encode())


def read_tokens(path: str | os.PathLike) -> np.memmap:
    """The token file written by `write_tokens`, memory-mapped read-only."""
    path = os.fspath(path)
    try:
        with open(path + ".json", encoding="utf-8") as handle:
            meta = json.load(handle)
        dtype, length = np.dtype(meta["dtype"]), int(meta["length"])
    except FileNotFoundError:
        raise QkvError(f"{path}.json: token file description not found") from None
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise QkvError(f"{path}.json: corrupt token file description: {error}") from None
    if dtype not in (np.uint16, np.uint32):
        raise QkvError(f"{path}.json: unsupported dtype {dtype.name}; expected uint16 or uint32")
    size = os.path.getsize(path) if os.path.exists(path) else None
    if size != length * dtype.itemsize:
        raise QkvError(f"{path}: expected {length * dtype.itemsize} bytes ({length} tokens), found {size}")
    if length == 0:
        return np.zeros(0, dtype)  # mmap cannot map an empty file
    return np.memmap(path, dtype=dtype, mode="r", shape=(length,))


def chunk_text(text: str, chunk_chars: int = CHUNK_CHARS) -> list[str]:
    """Cuts `text` into pieces of about `chunk_chars`, only at pre-tokenizer boundaries (see _SAFE_CUT)."""
    chunks, start = [], 0
    while len(text) - start > chunk_chars:
        match = _SAFE_CUT.search(text, start + chunk_chars)
        if match is None:
            break
        chunks.append(text[start : match.end()])
        start = match.end()
    chunks.append(text[start:])
    return chunks


def encode_stream(tokenizer: Tokenizer, texts: Sequence[str], chunk_chars: int = CHUNK_CHARS) -> np.ndarray:
    """[eos] + encode(join(texts)), tokenized chunk by chunk in parallel."""
    pieces = tokenizer.encode_batch(chunk_text(JOINER.join(texts), chunk_chars))
    return np.concatenate([np.array([tokenizer.eos_id], np.int64), *(np.array(p, np.int64) for p in pieces)])


@dataclass
class Prepared:
    tokenizer: Tokenizer
    train: np.ndarray  # (N_train,) memmap, starts with eos
    val: np.ndarray  # (N_val,) memmap, starts with eos
    val_chars: int  # characters of the joined validation text (for bits per character)
    cache_dir: Path  # the cache entry holding these files


def default_cache_dir() -> Path:
    return Path(os.environ.get("QKV_CACHE") or Path.home() / ".cache" / "qkv")


def _load_entry(entry: Path) -> Prepared:
    try:
        val_chars = int(json.loads((entry / "meta.json").read_text(encoding="utf-8"))["val_chars"])
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise QkvError(f"{entry / 'meta.json'}: corrupt cache entry ({error}); delete {entry}") from None
    return Prepared(
        tokenizer=Tokenizer.load(entry / "tokenizer.json"),
        train=read_tokens(entry / "train.bin"),
        val=read_tokens(entry / "val.bin"),
        val_chars=val_chars,
        cache_dir=entry,
    )


def _build_entry(tmp: Path, train_texts: Sequence[str], val_texts: Sequence[str], vocab_size: int,
                 tokenizer: Tokenizer | None = None) -> None:
    tokenizer = tokenizer or Tokenizer.train(chunk_text(JOINER.join(train_texts)), vocab_size)
    tokenizer.save(tmp / "tokenizer.json")
    write_tokens(tmp / "train.bin", encode_stream(tokenizer, train_texts), tokenizer.vocab_size)
    write_tokens(tmp / "val.bin", encode_stream(tokenizer, val_texts), tokenizer.vocab_size)
    meta = {"val_chars": len(JOINER.join(val_texts)), "vocab_size": tokenizer.vocab_size, "version": CACHE_VERSION}
    (tmp / "meta.json").write_text(json.dumps(meta), encoding="utf-8")  # written last: marks a complete entry


def prepare(train_texts: Sequence[str], val_texts: Sequence[str], vocab_size: int, cache_dir: Path,
            tokenizer: Tokenizer | None = None) -> Prepared:
    """Train the tokenizer on the training text and tokenize both splits, or reuse the cached result.
    With `tokenizer` (a resumed or imported run's own), no tokenizer is trained and that one is used.

    The cache key covers every text, where train ends and val begins, the vocab size and CACHE_VERSION.
    An entry is built in a temporary folder and renamed into place, so it is complete or absent.
    """
    train_texts, val_texts = list(train_texts), list(val_texts)
    if not "".join(train_texts).strip():
        raise QkvError("no training text: every training document is empty")
    fixed = tokenizer.to_str() if tokenizer is not None else ""
    key = content_hash(train_texts + val_texts, str(vocab_size), str(len(train_texts)), CACHE_VERSION, fixed)
    entry = Path(cache_dir) / key
    if not (entry / "meta.json").exists():
        entry.parent.mkdir(parents=True, exist_ok=True)
        with _building(entry):  # the ranks of a torchrun launch: one tokenizes, the others wait for its entry
            if not (entry / "meta.json").exists():
                _build(entry, key, train_texts, val_texts, vocab_size, tokenizer)
    return _load_entry(entry)


class _building:
    """An exclusive lock on `entry`'s lock file (flock: released when the process ends, whatever happens).
    The holder removes the file when done: a process still waiting holds the old file and finds the entry
    built; one that comes later sees the entry before it locks anything. No lock file stays in the cache."""

    def __init__(self, entry: Path):
        self.path = entry.with_name(entry.name + ".lock")

    def __enter__(self):
        self.handle = open(self.path, "a")
        if fcntl is not None:
            fcntl.flock(self.handle, fcntl.LOCK_EX)

    def __exit__(self, *exc):
        self.path.unlink(missing_ok=True)
        self.handle.close()  # closing releases the lock
        return False


def _build(entry: Path, key: str, train_texts: Sequence[str], val_texts: Sequence[str], vocab_size: int,
           tokenizer: Tokenizer | None) -> None:
    tmp = Path(tempfile.mkdtemp(prefix=f"{key}.tmp-", dir=entry.parent))
    try:
        _build_entry(tmp, train_texts, val_texts, vocab_size, tokenizer)
        os.replace(tmp, entry)
    except OSError:
        if not (entry / "meta.json").exists():  # not another process finishing first
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


class Batches:
    """Random training windows, reproducible and resumable.

    Each global batch holds `batch_size` windows of seq_len + 1 tokens starting at uniform offsets in
    [0, len - seq_len - 1], drawn from Generator(PCG64(seed)). With world > 1, every rank draws the same
    global batch and keeps rows rank::world, so ranks see disjoint rows that together form the batch.
    """

    def __init__(self, tokens: np.ndarray, seq_len: int, batch_size: int, seed: int, rank: int = 0, world: int = 1):
        if len(tokens) <= seq_len + 1:
            raise QkvError(
                f"token stream too short: {len(tokens)} tokens, but seq_len={seq_len} needs more than {seq_len + 1}"
            )
        if world < 1 or not 0 <= rank < world or batch_size % world:
            raise QkvError(f"batch_size={batch_size} must split evenly over world={world} (rank={rank})")
        self.tokens, self.seq_len, self.batch_size = tokens, seq_len, batch_size
        self.rank, self.world = rank, world
        self._rng = np.random.Generator(np.random.PCG64(seed))
        self.drawn = 0

    def next(self) -> tuple[np.ndarray, np.ndarray]:
        """(inputs, targets), each (batch_size // world, seq_len) int64; targets = inputs shifted by one."""
        starts = self._rng.integers(0, len(self.tokens) - self.seq_len, size=self.batch_size)  # (B,)
        self.drawn += 1
        index = starts[self.rank :: self.world, None] + np.arange(self.seq_len + 1)  # (B/world, T+1)
        windows = np.asarray(self.tokens[index], dtype=np.int64)  # (B/world, T+1)
        return windows[:, :-1], windows[:, 1:]

    def state(self) -> dict:
        return {"bit_generator": self._rng.bit_generator.state, "batches": self.drawn, "seq_len": self.seq_len,
                "batch_size": self.batch_size}

    def load_state(self, state: dict) -> None:
        if (state.get("seq_len"), state.get("batch_size")) != (self.seq_len, self.batch_size):
            raise QkvError(
                f"data state is for seq_len={state.get('seq_len')}, batch_size={state.get('batch_size')}; "
                f"this run has seq_len={self.seq_len}, batch_size={self.batch_size}"
            )
        self._rng.bit_generator.state = state["bit_generator"]
        self.drawn = int(state["batches"])


def eval_windows(tokens: np.ndarray, seq_len: int, stride: int) -> Iterator[tuple[np.ndarray, np.ndarray, int]]:
    """Sliding windows over a whole stream: yields (inputs (t,), targets (t,), score_from), t <= seq_len.

    Score targets[score_from:]; over all windows every token after position 0 is scored exactly once, with
    at least min(position, seq_len - stride + 1) and at most seq_len tokens of context (Hugging Face,
    "Perplexity of fixed-length models"; unlike there, the last window is moved back to full length).
    """
    if not 1 <= stride <= seq_len:
        raise QkvError(f"stride must be between 1 and seq_len={seq_len}, got {stride}")
    if len(tokens) < 2:
        raise QkvError(f"need at least 2 tokens to score, got {len(tokens)}")
    scored_until = 1  # token indices < scored_until are scored (index 0 never is)
    for begin in range(0, len(tokens) - 1, stride):
        end = min(begin + seq_len + 1, len(tokens))
        begin = max(0, end - seq_len - 1)  # the last window ends at the stream's end with full context
        window = np.asarray(tokens[begin:end], dtype=np.int64)  # (t+1,)
        yield window[:-1], window[1:], scored_until - (begin + 1)
        scored_until = end
        if end == len(tokens):
            return
