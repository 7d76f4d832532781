"""Writing a run as a GGUF file llama.cpp and Ollama run (`qkv convert RUN --to-gguf OUT.gguf --dtype ...`).

The model goes out through the Hugging Face family that exports it (qkv.formats.hf: llama or gpt2 shapes),
then as llama.cpp's converter stores that checkpoint (Q/K rows permuted for llama, Conv1D weights transposed
for gpt2); the matrices in `dtype` (f32, f16, bf16, q8_0, q4_0: quantized by the gguf package), the vectors in
f32. The tokenizer goes out as a byte-level BPE (`tokenizer.ggml.model = gpt2`) with its merges, its special
tokens typed CONTROL and the pre-tokenizer named as llama.cpp names it; BOS is qkv's start token (the
end-of-text a prompt starts with) and is added to every prompt, as `qkv generate` does; EOS is the model's
end-of-turn id where it has one. The chat template goes too. The file is written next to `out` and renamed
into place: an existing file is never overwritten.
"""
from __future__ import annotations

import json
import os
import re
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import numpy as np

from qkv.errors import QkvError
from qkv.files import model_tensors
from qkv.formats.base import Run
from qkv.formats.gguf.archs import GGUF_ARCHS, GGUF_NAMES
from qkv.formats.gguf.tokenizer import LLAMA3_SPLIT, QWEN2_SPLIT
from qkv.formats.hf import exporter
from qkv.formats.hf.moe import stack

DTYPES = ("f32", "f16", "bf16", "q8_0", "q4_0")
PRE_NAMES = {QWEN2_SPLIT: "qwen2", LLAMA3_SPLIT: "llama-bpe"}  # a Split regex before the byte mapping


def save(run: Run, out: str | Path, dtype: str = "f32") -> Path:
    import gguf

    out = Path(out)
    if dtype not in DTYPES:
        raise QkvError(f"--dtype {dtype!r} is not allowed; choose from: {', '.join(DTYPES)}")
    if out.exists():
        raise QkvError(f"{out} already exists; choose another file")
    cfg = run.config.model
    family = exporter(cfg)  # (first: a model no family or architecture writes says so before anything else)
    _, hf = family.hf_config(cfg)
    name = GGUF_NAMES.get(hf["model_type"], hf["model_type"])  # llama.cpp's name of the architecture
    writes = [n for n in GGUF_ARCHS.names() if GGUF_ARCHS.get(n).metadata is not None]
    if name not in writes:
        raise QkvError(f"a {hf['model_type']} model has no GGUF form in qkv; it writes {', '.join(writes)} shapes")
    arch = GGUF_ARCHS.get(name)
    metadata = arch.metadata(hf)
    if run.tokenizer is None:
        raise QkvError(f"{run.path}: has no tokenizer, which a GGUF file carries")
    kind = gguf.GGMLQuantizationType[dtype.upper()]
    tensors = stack(family.to_hf(model_tensors(run.model), cfg))  # (an MoE's experts as one tensor each)
    with gguf_file(out, name) as writer:
        writer.add_name(Path(run.path).name)
        for key, value in metadata.items():
            writer.add_key_value(f"{name}.{key}", value, value_type(value))
        add_tokenizer(writer, run)
        for name, tensor in tensors.items():
            w = arch.from_hf(name, tensor.detach().float().cpu().numpy(), hf)
            add_tensor(writer, arch.gguf_name(name), w, kind)
        for name, w in (arch.write_settings(hf) if arch.write_settings else {}).items():  # llama's rope_freqs
            add_tensor(writer, name, w, kind)
    return out


@contextmanager
def gguf_file(out: Path, arch: str) -> Iterator:
    """A gguf.GGUFWriter for `out`: written next to it, renamed into place when the block ends without an error,
    removed when it raises (`out` itself never half-written)."""
    import gguf

    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent)
    os.close(fd)
    try:
        writer = gguf.GGUFWriter(tmp, arch)
        yield writer
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        os.replace(tmp, out)
    finally:
        Path(tmp).unlink(missing_ok=True)


def value_type(value):
    import gguf

    if isinstance(value, str):
        return gguf.GGUFValueType.STRING
    return gguf.GGUFValueType.FLOAT32 if isinstance(value, float) else gguf.GGUFValueType.UINT32


def add_tensor(writer, name: str, w: np.ndarray, kind) -> None:
    """A matrix in `kind`, a vector (norm gains, biases) in f32; a matrix whose rows its blocks cannot hold
    stays f32 too, as llama.cpp's converter keeps it."""
    import gguf

    w = np.ascontiguousarray(w, dtype=np.float32)
    block = gguf.GGML_QUANT_SIZES[kind][0]
    if w.ndim < 2 or w.shape[-1] % block or kind == gguf.GGMLQuantizationType.F32:
        writer.add_tensor(name, w, raw_dtype=gguf.GGMLQuantizationType.F32)
    else:
        writer.add_tensor(name, gguf.quants.quantize(w, kind), raw_dtype=kind)


def add_tokenizer(writer, run: Run) -> None:
    raw = json.loads(run.tokenizer.to_str())
    model = raw.get("model", {})
    if model.get("type") != "BPE":
        raise QkvError(f"{run.path}: its tokenizer is {model.get('type')}, and qkv writes byte-level BPE to GGUF")
    vocab = {**model["vocab"], **{t["content"]: t["id"] for t in raw.get("added_tokens", [])}}
    # llama.cpp wants a token for every embedding row: rows past the tokenizer's (Qwen2.5 keeps 271 spare) get
    # "[PAD{i}]" typed UNUSED, as its converter names them
    rows = max(max(vocab.values()) + 1, run.config.model.vocab_size)
    tokens = [f"[PAD{i}]" for i in range(rows)]
    for token, index in vocab.items():
        tokens[index] = token
    used = set(vocab.values())
    padding = {tokens[i] for i in range(rows) if i not in used}
    special = {t["content"] for t in raw.get("added_tokens", []) if t.get("special")}
    if model.get("byte_fallback"):  # SentencePiece's BPE (Gemma): pieces ranked by their order, as read
        add_sentencepiece(writer, raw, tokens, special, padding)
    else:
        merges = [" ".join(m) if isinstance(m, list) else m for m in model.get("merges", [])]
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre(pre_name(raw.get("pre_tokenizer"), run.path))
        writer.add_token_list(tokens)
        writer.add_token_types([3 if token in special else 5 if token in padding else 1 for token in tokens])
        writer.add_token_merges(merges)
    writer.add_bos_token_id(run.tokenizer.start_id)  # qkv starts every prompt with it (end-of-text, or <bos>)
    writer.add_add_bos_token(True)
    writer.add_eos_token_id(run.chat.stop_ids[0] if run.chat.stop_ids else run.tokenizer.eos_id)
    if run.chat.template is not None:
        writer.add_chat_template(run.chat.template)


def add_sentencepiece(writer, raw: dict, tokens: list[str], special: set[str], padding: set[str] = frozenset()) -> None:
    """`tokenizer.ggml.model = llama`: the pieces (those of spaces alone spelled with spaces, as Gemma's files
    keep them), scores that rank them by their order (what qkv and transformers read from such a file), the
    byte tokens typed BYTE (6), and whether a "▁" goes before the text (a Metaspace pre-tokenizer)."""
    import gguf

    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list([" " * len(t) if t and not t.strip("▁") else t for t in tokens])
    writer.add_token_scores([-float(i) for i in range(len(tokens))])
    byte = re.compile(r"<0x[0-9A-F]{2}>")
    writer.add_token_types([gguf.TokenType.CONTROL if t in special else gguf.TokenType.BYTE if byte.fullmatch(t)
                            else gguf.TokenType.UNUSED if t in padding else gguf.TokenType.NORMAL for t in tokens])
    writer.add_add_space_prefix((raw.get("pre_tokenizer") or {}).get("type") == "Metaspace")
    unknown = raw["model"].get("unk_token")
    if unknown in tokens:
        writer.add_unk_token_id(tokens.index(unknown))


def pre_name(pre: dict | None, origin) -> str:
    """llama.cpp's name for the run's pre-tokenizer: GPT-2's regex, or a Split regex it knows."""
    if pre and pre.get("type") == "ByteLevel" and pre.get("use_regex", True):
        return "gpt-2"
    steps = (pre or {}).get("pretokenizers", [])
    if len(steps) == 2 and steps[0].get("type") == "Split" and steps[1].get("type") == "ByteLevel":
        regex = steps[0].get("pattern", {}).get("Regex")
        if regex in PRE_NAMES:
            return PRE_NAMES[regex]
    raise QkvError(f"{origin}: its tokenizer splits text in a way GGUF has no name for ({json.dumps(pre)[:80]})")
