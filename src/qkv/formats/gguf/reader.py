"""Reading a GGUF file (llama.cpp's format) safely: the header is checked against the file before the `gguf`
package (the llama.cpp project's own reader, a memory map) parses it, and every tensor's shape and bytes
against its type's block size and the file's end. Nothing is allocated from a count in the header.

    file = GgufFile.open(path)        # QkvError naming the file and the problem for anything malformed
    file.metadata["llama.block_count"], file.names, file.tensor("blk.0.attn_q.weight") -> float32 ndarray
"""
from __future__ import annotations

import mmap
import struct
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from qkv.errors import QkvError

MAGIC = b"GGUF"
VERSIONS = (2, 3)
HEADER = struct.Struct("<4sIQQ")  # magic, version, tensor count, metadata count
MAX_COUNT = 1 << 24  # tensors or metadata entries: far more than any model has


def is_gguf(path: Path) -> bool:
    """A file that starts with the GGUF magic."""
    try:
        with open(path, "rb") as f:
            return f.read(4) == MAGIC
    except OSError:
        return False


def check_header(path: Path) -> None:
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(HEADER.size)
    if len(head) < HEADER.size:
        raise QkvError(f"{path}: truncated GGUF file ({size} bytes, shorter than its {HEADER.size}-byte header)")
    magic, version, tensors, entries = HEADER.unpack(head)
    if magic != MAGIC:
        raise QkvError(f"{path}: not a GGUF file (magic {magic!r}, expected {MAGIC!r})")
    if version not in VERSIONS:
        raise QkvError(f"{path}: GGUF version {version} is not supported (supported: {', '.join(map(str, VERSIONS))})")
    for count, what in ((tensors, "tensor"), (entries, "metadata")):
        if count > min(MAX_COUNT, size):  # every entry takes bytes of the file
            raise QkvError(f"{path}: the header claims {count:,} {what} entries, more than a {size:,}-byte file holds")


def plain_reader(gguf):
    """gguf.GGUFReader, its reads sliced from a plain ndarray view of its memory map rather than from the
    np.memmap itself: the same bytes, but a memmap slice costs about 2 us in numpy's __array_finalize__, and a
    tokenizer's 49,152 strings are some 250,000 slices (SmolLM2's header: 2.0 s -> 0.7 s). Where the package's
    private `_get` is called otherwise than this expects, its own runs."""

    class Reader(gguf.GGUFReader):
        def _get(self, offset, dtype, count=1, override_order=None, *rest, **named):
            plain = self.__dict__.get("_plain")
            if plain is None:
                plain = self._plain = self.data.view(np.ndarray)  # (a view: the memory map stays open)
            if rest or named or override_order not in (None, "I", "S", "<"):
                return super()._get(offset, dtype, count, override_order, *rest, **named)
            count = int(count)
            arr = plain[offset:offset + np.dtype(dtype).itemsize * count].view(dtype=dtype)[:count]
            return arr.view(arr.dtype.newbyteorder(self.byte_order if override_order is None else override_order))

        def _get_field_parts(self, orig_offs, raw_type, *rest, **named):
            """An array read at once, where the package recurses into each element and makes two ndarray parts a
            string: numbers as one part holding them all (`contents()` lists it), strings decoded into one
            `Strings` part (`contents_of` takes it whole). Gemma 3's header of 262,144 tokens, scores and types:
            2.9 s with the package's reading, 0.25 s. The same contents (tests/formats/gguf/test_reader.py)."""
            strings = gguf.GGUFValueType.STRING
            if (rest or named or gguf.GGUFValueType(raw_type) != gguf.GGUFValueType.ARRAY or self.byte_order != "I"
                    or sys.byteorder != "little"):
                return super()._get_field_parts(orig_offs, raw_type, *rest, **named)
            item_type = self._get(orig_offs, np.uint32)
            count = self._get(orig_offs + 4, np.uint64)
            n = int(count[0])
            scalar = self.gguf_scalar_to_np.get(gguf.GGUFValueType(int(item_type[0])))
            if scalar is not None:  # one part: contents() lists it whole
                if orig_offs + 12 + n * np.dtype(scalar).itemsize > len(self._plain):
                    raise ValueError(f"an array of {n:,} numbers runs past the end of the file")
                values = self._get(orig_offs + 12, scalar, n)
                types = [gguf.GGUFValueType.ARRAY] + ([gguf.GGUFValueType(int(item_type[0]))] if n else [])
                return 12 + int(values.nbytes), [item_type, count, values], [2] if n else [], types
            if int(item_type[0]) != strings:
                return super()._get_field_parts(orig_offs, raw_type, *rest, **named)
            view = self.__dict__.get("_view")
            if view is None:
                view = self._view = memoryview(self._plain)
            strings_read, offset, end = Strings(), orig_offs + 12, len(view)
            for _ in range(n):
                if offset + 8 > end:
                    raise ValueError(f"a string array runs past the end of the file at {offset}")
                (size,) = LENGTH.unpack_from(view, offset)
                if offset + 8 + size > end:
                    raise ValueError(f"a string of {size:,} bytes runs past the end of the file at {offset}")
                strings_read.append(str(view[offset + 8:offset + 8 + size], "utf-8"))
                offset += 8 + size
            types = [gguf.GGUFValueType.ARRAY] + ([strings] if n else [])
            return offset - orig_offs, [item_type, count, strings_read], [2], types

    return Reader


LENGTH = struct.Struct("<Q")  # a GGUF string's length prefix (little-endian files: plain_reader's fast path)


class Strings(list):
    """A string array decoded as it was read: the one data part of its field (`contents_of`)."""


def contents_of(field):
    """A field's value: a `Strings` part whole, else the package's `contents()`."""
    part = field.parts[field.data[0]] if field.data else None
    return list(part) if isinstance(part, Strings) else field.contents()


@dataclass
class GgufFile:
    path: Path
    metadata: dict
    tensors: dict  # name -> gguf.ReaderTensor (its data a view of the memory map)
    mapping: mmap.mmap | None = field(default=None, repr=False)  # the memory map itself

    @classmethod
    def open(cls, path: str | Path) -> GgufFile:
        import gguf

        path = Path(path)
        if not path.is_file():
            raise QkvError(f"{path}: no such GGUF file")
        check_header(path)
        try:
            reader = plain_reader(gguf)(path)
            metadata = {name: contents_of(field) for name, field in reader.fields.items()
                        if not name.startswith("GGUF.")}
        except (ValueError, IndexError, KeyError, TypeError, OverflowError, UnicodeDecodeError, struct.error,
                MemoryError) as exc:
            raise QkvError(f"{path}: not a readable GGUF file ({reason(exc, path)})") from None
        size = path.stat().st_size
        tensors = {}
        for tensor in reader.tensors:
            check_tensor(path, tensor, size)
            tensors[tensor.name] = tensor
        return cls(path=path, metadata=metadata, tensors=tensors, mapping=getattr(reader.data, "_mmap", None))

    def release(self) -> None:
        """The file's pages out of this process's resident memory (madvise DONTNEED on the read-only map): a
        tensor read is a copy, and the map's pages (Gemma 3's 253 MB) would stay counted beside the copies until
        the file is closed; a view still held reads its pages again from the page cache. Cheap: called after
        every tensor."""
        if self.mapping is not None and hasattr(mmap, "MADV_DONTNEED"):
            self.mapping.madvise(mmap.MADV_DONTNEED)

    @property
    def names(self) -> list[str]:
        return list(self.tensors)

    def get(self, key: str, default=None):
        return self.metadata.get(key, default)

    def tensor(self, name: str) -> np.ndarray:
        """The tensor as float32 (rows, columns) in PyTorch's (out, in) order, dequantized by the gguf package
        a few rows at a time straight into its own, writable array (the package's whole-tensor dequantization
        holds several float copies at once: for SmolLM2's 49,152 x 576 embedding, 0.2 GB more at the peak); the
        file's pages read released again."""
        import gguf

        if name not in self.tensors:
            raise QkvError(f"{self.path}: has no tensor {name!r}")
        tensor = self.tensors[name]
        shape = tuple(int(n) for n in reversed(tensor.shape.tolist()))  # ggml lists the fastest axis first
        raw = np.asarray(tensor.data)
        raw = raw.reshape(-1, raw.shape[-1])  # (rows, one row's values or blocks)
        out = np.empty(shape, dtype=np.float32)
        flat = out.reshape(raw.shape[0], -1)
        step = max(1, DEQUANTIZE_ELEMENTS // flat.shape[1])
        for start in range(0, raw.shape[0], step):
            rows = slice(start, start + step)
            flat[rows] = gguf.quants.dequantize(raw[rows], tensor.tensor_type).reshape(flat[rows].shape)
        self.release()
        return out


DEQUANTIZE_ELEMENTS = 2 ** 20  # values dequantized at once (4 MiB of float32)


def reason(exc: Exception, path: Path) -> str:
    """What the gguf package's error says about the file. Its reader slices the memory map at the offsets and
    lengths the file states; a slice cut short by the end of the file is what fails to take its shape."""
    if "cannot reshape" in str(exc) or isinstance(exc, IndexError):
        return f"a metadata value or tensor runs past the end of the file ({path.stat().st_size:,} bytes)"
    return f"{type(exc).__name__}: {str(exc)[:120]}"


def check_tensor(path: Path, tensor, size: int) -> None:
    """Its type is known, its row length a whole number of blocks, and its bytes inside the file."""
    import gguf

    kind = tensor.tensor_type
    if kind not in gguf.GGML_QUANT_SIZES:
        raise QkvError(f"{path}: tensor {tensor.name} has an unknown type {int(kind)}")
    block, block_bytes = gguf.GGML_QUANT_SIZES[kind]
    shape = [int(n) for n in tensor.shape.tolist()]
    if shape and any(n <= 0 for n in shape):
        raise QkvError(f"{path}: tensor {tensor.name} has shape {shape}: an empty dimension"
                       + (" (a LoRA rank of 0)" if tensor.name.endswith((".lora_a", ".lora_b")) else ""))
    if not shape or shape[0] % block:
        raise QkvError(f"{path}: tensor {tensor.name} has shape {shape}, which {kind.name} blocks of {block} "
                       f"values cannot hold")
    need = int(np.prod(shape, dtype=np.int64)) // block * block_bytes
    if tensor.data_offset + need > size or tensor.n_bytes != need:
        raise QkvError(f"{path}: tensor {tensor.name} points past the end of the file ({tensor.data_offset:,} + "
                       f"{need:,} bytes, the file has {size:,})")
