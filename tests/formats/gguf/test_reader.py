"""qkv.formats.gguf.reader and the loader on hostile files: each is one `qkv: error:` line naming the problem,
exit 2, no traceback; nothing is allocated from a header count before it is checked against the file's size;
nothing existing is overwritten."""
import os
import struct

import gguf
import pytest

from tests.cli.test_main import assert_one_error_line, cli
from tests.formats.gguf import write_llama


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    return write_llama(tmp_path_factory.mktemp("gguf") / "good.gguf", qtype="Q8_0")


def patched(good, tmp_path, offset: int, value: bytes, name="bad.gguf"):
    data = bytearray(good.read_bytes())
    data[offset:offset + len(value)] = value
    (tmp_path / name).write_bytes(bytes(data))
    return tmp_path / name


def tensor_info(good, name: str) -> tuple[int, int]:
    """(offset of the tensor's type field, its number of dimensions) in the file's tensor-info table."""
    tensor = next(t for t in gguf.GGUFReader(good).tensors if t.name == name)
    n_dims = len(tensor.shape)
    return tensor.field.offset + 8 + len(name.encode()) + 4 + 8 * n_dims, n_dims


def string_value(good, key: str) -> int:
    """The offset of the length of metadata `key`'s string value."""
    field = gguf.GGUFReader(good).fields[key]
    return field.offset + 8 + len(key.encode()) + 4


def cases(good, tmp_path):
    size = good.stat().st_size
    type_at, _ = tensor_info(good, "blk.0.attn_q.weight")
    yield "truncated", lambda: truncate(good, tmp_path, size // 2), "runs past the end of the file"
    yield "header only", lambda: truncate(good, tmp_path, 10), "truncated GGUF file"
    yield "bad magic", lambda: patched(good, tmp_path, 0, b"GGML"), "not a GGUF file"
    yield "version", lambda: patched(good, tmp_path, 4, struct.pack("<I", 99)), "GGUF version 99 is not supported"
    yield "tensor count", lambda: patched(good, tmp_path, 8, struct.pack("<Q", 2 ** 40)), "tensor entries"
    yield "past the end", lambda: truncate(good, tmp_path, size - 100), "runs past the end of the file"
    yield "unknown type", lambda: patched(good, tmp_path, type_at, struct.pack("<I", 99)), "GGUF"
    yield "string of 2^60", lambda: patched(good, tmp_path, string_value(good, "general.architecture"),
                                             struct.pack("<Q", 2 ** 60)), "GGUF"


def truncate(good, tmp_path, size):
    (tmp_path / "bad.gguf").write_bytes(good.read_bytes()[:size])
    return tmp_path / "bad.gguf"


@pytest.mark.parametrize("case", ["truncated", "header only", "bad magic", "version", "tensor count",
                                  "past the end", "unknown type", "string of 2^60"])
def test_a_malformed_file_is_one_error_line(capsys, good, tmp_path, case):
    make, message = next((make, message) for name, make, message in cases(good, tmp_path) if name == case)
    bad = make()
    assert_one_error_line(*cli(capsys, "generate", bad, "--prompt", "x", "--max-new-tokens", "2"), message)
    out = tmp_path / "kept"
    out.mkdir()
    (out / "mine.txt").write_text("keep")
    assert_one_error_line(*cli(capsys, "convert", "--from-gguf", bad, "--out", out), "")
    assert (out / "mine.txt").read_text() == "keep" and sorted(p.name for p in out.iterdir()) == ["mine.txt"]


def test_a_shape_that_its_blocks_cannot_hold_is_refused(capsys, tmp_path):
    """A Q8_0 tensor whose rows are 33 values long: 32-value blocks cannot hold it (its shape field patched)."""
    good = write_llama(tmp_path / "g.gguf", qtype="Q8_0")
    tensor = next(t for t in gguf.GGUFReader(good).tensors if t.name == "blk.0.attn_q.weight")
    first_dim = tensor.field.offset + 8 + len(tensor.name.encode()) + 4
    bad = patched(good, tmp_path, first_dim, struct.pack("<Q", 33))
    assert_one_error_line(*cli(capsys, "generate", bad, "--prompt", "x"), "33", "not a multiple of Q8_0 block size")


def test_an_architecture_qkv_does_not_run_is_named(capsys, tmp_path):
    good = write_llama(tmp_path / "g.gguf")
    at = string_value(good, "general.architecture")
    bad = patched(good, tmp_path, at + 8, b"mamba")  # "llama" -> "mamba", same length
    assert_one_error_line(*cli(capsys, "generate", bad, "--prompt", "x"), "GGUF architecture 'mamba' is not supported")


def test_a_vocabulary_larger_than_the_embedding_and_a_missing_tokenizer(capsys, tmp_path):
    small = write_llama(tmp_path / "v.gguf", vocab=200)
    assert_one_error_line(*cli(capsys, "generate", small, "--prompt", "x"), "more than the model's vocab_size=200")
    none = write_llama(tmp_path / "t.gguf", tokenizer=False)
    assert_one_error_line(*cli(capsys, "generate", none, "--prompt", "x"), "has no tokenizer")


def test_a_template_that_raises_is_one_error_line(capsys, tmp_path, monkeypatch):
    path = write_llama(tmp_path / "r.gguf", template="{{ raise_exception('only user turns') }}")
    monkeypatch.setattr("sys.stdin", __import__("io").StringIO("hello\n"))
    assert_one_error_line(*cli(capsys, "chat", path, "--max-new-tokens", "2"), "only user turns")


@pytest.mark.parametrize("endian", [gguf.GGUFEndian.LITTLE, gguf.GGUFEndian.BIG])
def test_the_plain_reader_reads_what_the_gguf_package_reads(good, tmp_path, endian):
    """GgufFile's reader (plain ndarray slices of the memory map, arrays read at once:
    qkv.formats.gguf.reader.plain_reader) against the package's own: every field's name, offset, types and value
    (a scalar's parts too), every tensor's name, type, shape and bytes, on a model file and on one holding each
    kind of value, in both byte orders."""
    import numpy as np

    from qkv.formats.gguf.reader import contents_of, plain_reader

    kinds = tmp_path / "kinds.gguf"
    writer = gguf.GGUFWriter(kinds, "llama", endianess=endian)
    writer.add_uint8("k.u8", 7)
    writer.add_int16("k.i16", -3)
    writer.add_uint64("k.u64", 2 ** 40)
    writer.add_float64("k.f64", 0.1)
    writer.add_bool("k.b", True)
    writer.add_string("k.s", "h\u00e9llo")
    writer.add_array("k.strings", ["a", "", "\u00fc" * 3])
    writer.add_array("k.ints", [1, -2, 3])
    writer.add_array("k.floats", [0.5, 1.5])
    writer.add_tensor("t", np.arange(12, dtype=np.float32).reshape(3, 4))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    for path in (good, kinds) if endian == gguf.GGUFEndian.LITTLE else (kinds,):
        theirs, ours = gguf.GGUFReader(path), plain_reader(gguf)(path)
        assert list(ours.fields) == list(theirs.fields)
        for name, field in theirs.fields.items():
            mine = ours.fields[name]
            assert (mine.offset, mine.types) == (field.offset, field.types), name
            assert contents_of(mine) == field.contents(), name
            if field.types[0] != gguf.GGUFValueType.ARRAY or endian == gguf.GGUFEndian.BIG:  # as the package reads
                assert mine.data == field.data, name
                assert [p.tobytes() for p in mine.parts] == [p.tobytes() for p in field.parts], name
                assert [p.dtype for p in mine.parts] == [p.dtype for p in field.parts], name
        assert len(ours.tensors) == len(theirs.tensors)
        for mine, tensor in zip(ours.tensors, theirs.tensors):
            assert (mine.name, mine.tensor_type, mine.shape.tolist(), mine.data_offset) == \
                   (tensor.name, tensor.tensor_type, tensor.shape.tolist(), tensor.data_offset)
            assert mine.data.dtype == tensor.data.dtype and mine.data.tobytes() == tensor.data.tobytes()
    assert contents_of(plain_reader(gguf)(kinds).fields["k.strings"]) == ["a", "", "\u00fc" * 3]


def resident_bytes_of(path) -> int:
    """How much of the file's memory map this process holds resident (Linux's /proc/self/smaps)."""
    total, inside = 0, False
    for line in open("/proc/self/smaps", encoding="utf-8"):
        if line[0] in "0123456789abcdef" and " " in line:  # a mapping's header line
            inside = line.rstrip().endswith(str(path))
        elif inside and line.startswith("Rss:"):
            total += int(line.split()[1]) * 1024
    return total


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="reads Linux's /proc/self/smaps")
def test_a_tensor_read_leaves_none_of_the_files_pages_resident(tmp_path, monkeypatch):
    """GgufFile.release after each tensor: the tensors read are copies, the map's pages are given back (Gemma 3's
    253 MB would otherwise count beside its weights); without it nearly the whole file stays resident."""
    from qkv.formats.gguf.reader import GgufFile

    path = write_llama(tmp_path / "m.gguf", width=256, ffn=512).resolve()
    size = path.stat().st_size
    file = GgufFile.open(path)
    tensors = {name: file.tensor(name) for name in file.names}
    assert resident_bytes_of(path) <= 0.02 * size
    assert sum(t.nbytes for t in tensors.values()) >= 0.9 * size
    monkeypatch.setattr(GgufFile, "release", lambda self: None)
    kept = GgufFile.open(path)
    tensors = {name: kept.tensor(name) for name in kept.names}
    assert resident_bytes_of(path) >= 0.9 * size


def test_the_real_files_metadata_is_the_packages():
    """SmolLM2's 49,152 tokens, their merges, scores and types, read at once: every value equal to the gguf
    package's own reading of the file (Gemma 3's 262,144 read so: its tokenizer's ids equal transformers', in
    tests/formats/gguf/test_gemma3.py)."""
    from qkv.formats.gguf.reader import GgufFile
    from tests.formats.gguf.smollm2 import require_smollm2

    path = require_smollm2()
    theirs = {name: field.contents() for name, field in gguf.GGUFReader(path).fields.items()
              if not name.startswith("GGUF.")}
    ours = GgufFile.open(path).metadata
    assert ours.keys() == theirs.keys()
    for name in theirs:
        assert ours[name] == theirs[name], name
    assert len(ours["tokenizer.ggml.tokens"]) == 49152 and len(ours["tokenizer.ggml.merges"]) > 40000
