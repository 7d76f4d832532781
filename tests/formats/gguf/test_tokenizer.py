"""qkv.formats.gguf.tokenizer: the tokenizer of a GGUF file's metadata gives the ids transformers' own GGUF
tokenizer gives (the oracle), on plain text and on hostile strings: emoji, CJK, runs of spaces and newlines,
and the special tokens written as text (read as the tokens they name by encode_with_specials, as transformers
reads them; as plain text by encode)."""
import pytest

import qkv
from tests.formats.gguf import TEXT, write_llama

HOSTILE = ["🙂🎭 naïve café", "漢字とかな、한국어", "a    b\n\n\n\tc   ", "  leading", "trailing  \n",
           "<|im_start|>user\nhi<|im_end|>", "<|endoftext|>x<|endoftext|>", "", "'s 're 've 12345 ...!!"]


def transformers_tokenizer(path):
    import transformers

    return transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


@pytest.mark.parametrize("pre", ["default", "qwen2", "llama-bpe"])
def test_ids_equal_transformers_gguf_tokenizer(tmp_path, pre):
    path = rewrite_pre(write_llama(tmp_path / "m.gguf"), tmp_path / f"{pre}.gguf", pre)
    ours, theirs = qkv.load(path).tokenizer, transformers_tokenizer(path)
    for text in TEXT[:4] + HOSTILE:
        assert ours.encode_with_specials(text) == theirs(text, add_special_tokens=False).input_ids, text
        assert ours.decode(ours.encode(text)) == text


def test_a_sentencepiece_vocabulary_gives_transformers_ids_and_streams_its_bytes(tmp_path):
    """Llama 2's kind: "▁" pieces, <0xNN> byte fallback for what the pieces do not cover (emoji, CJK), merges
    implied by the scores; the EOS </s> respelled <|endoftext|>."""
    from qkv.data.tokenizer import StreamDecoder

    path = write_llama(tmp_path / "spm.gguf", tokenizer="sentencepiece")
    ours, theirs = qkv.load(path).tokenizer, transformers_tokenizer(path)
    assert ours.eos_id == 2
    # (the EOS </s> is spelled <|endoftext|> in qkv, docs/DEVIATIONS.md: a text spelling either is not compared)
    for text in TEXT[:4] + [text for text in HOSTILE if "<|endoftext|>" not in text] + ["<s>hi</s>"[:6]]:
        ids = ours.encode_with_specials(text)
        assert ids == theirs(text, add_special_tokens=False).input_ids, text
        plain = ours.encode(text)
        decoded = ours.decode(plain)
        assert decoded == theirs.decode(plain) and (decoded == text or text.startswith(" "))
        stream = StreamDecoder(ours)
        streamed = "".join(stream.push(i) for i in plain) + stream.flush()
        assert streamed == (" " + decoded if plain else "")  # decode strips the first space; the stream keeps it


def rewrite_pre(src, dst, pre):
    """The same file with tokenizer.ggml.pre = pre."""
    import gguf

    reader = gguf.GGUFReader(src)
    writer = gguf.GGUFWriter(str(dst), "llama")
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        value = pre if name == "tokenizer.ggml.pre" else field.contents()
        if field.types[0] == gguf.GGUFValueType.ARRAY:
            writer.add_array(name, value)
        else:
            writer.add_key_value(name, value, field.types[0])
    for tensor in reader.tensors:
        writer.add_tensor(tensor.name, tensor.data, raw_shape=list(reversed(tensor.shape.tolist())),
                          raw_dtype=tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


def test_a_files_tokenizer_is_derived_once_then_read_from_the_cache(tmp_path, monkeypatch):
    """cached_tokenizer: the first load derives the tokenizer from the metadata and keeps its JSON under
    QKV_CACHE; a later one (any file with that tokenizer metadata) reads it back: the same tokenizer, the same ids
    (on the hostile strings too); an unreadable entry is derived again and replaced; another tokenizer gets an
    entry of its own; a cache that cannot be written costs only the caching."""
    from qkv.formats.gguf import tokenizer as module
    from qkv.formats.gguf.reader import GgufFile

    monkeypatch.setenv("QKV_CACHE", str(tmp_path / "cache"))
    meta = GgufFile.open(write_llama(tmp_path / "m.gguf", tokenizer="sentencepiece")).metadata
    derived, real = [], module.gguf_tokenizer
    monkeypatch.setattr(module, "gguf_tokenizer", lambda m, origin: derived.append(origin) or real(m, origin))
    fresh = real(meta, "fresh")
    first, second = module.cached_tokenizer(meta, "first"), module.cached_tokenizer(meta, "second")
    assert derived == ["first"] and first.to_str() == second.to_str() == fresh.to_str()
    for text in TEXT[:2] + HOSTILE:
        assert second.encode_with_specials(text) == fresh.encode_with_specials(text), text
    entries = list((tmp_path / "cache" / "tokenizers").glob("*.json"))
    assert len(entries) == 1
    entries[0].write_text("{not json", encoding="utf-8")
    assert module.cached_tokenizer(meta, "third").to_str() == fresh.to_str() and derived == ["first", "third"]
    assert module.cached_tokenizer(meta, "fourth").to_str() == fresh.to_str() and len(derived) == 2  # (replaced)
    other = dict(meta, **{"tokenizer.ggml.add_bos_token": not meta.get("tokenizer.ggml.add_bos_token", True)})
    assert module.cached_tokenizer(other, "other").to_str() == real(other, "o").to_str()
    assert len(list((tmp_path / "cache" / "tokenizers").glob("*.json"))) == 2
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("QKV_CACHE", str(tmp_path / "file"))  # (a file: no directory can be made under it)
    assert module.cached_tokenizer(meta, "unwritable").to_str() == fresh.to_str()
