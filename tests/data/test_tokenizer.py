import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from qkv.data.tokenizer import EOS, StreamDecoder, Tokenizer, bytes_to_unicode
from qkv.errors import QkvError

TINY_TEXT = "To be, or not to be, that is the question:\nWhether 'tis nobler in the mind to suffer\n" * 20
TRICKY = [
    "", " leading", "trailing ", "a\r\nb\r\n", "\n\n\n", "e\u0301 combining", "😀👍🏽 emoji",
    EOS, f"x{EOS}y", "\x00\x7f\x80", "日本語のテキスト", "tab\tand  two  spaces",
]


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.train([TINY_TEXT], vocab_size=300)


def test_trained_vocab_has_bytes_eos_and_merges(tok):
    assert tok.vocab_size == 300
    assert tok.eos_id == 0 and tok.decode([tok.eos_id]) == EOS
    # frequent words are learned as single tokens; a never-seen word falls back to bytes
    assert len(tok.encode(" to be the mind")) == 4
    assert len(tok.encode("zqx")) == 3


def test_training_is_deterministic(tok):
    assert Tokenizer.train([TINY_TEXT], vocab_size=300).to_str() == tok.to_str()


def test_eos_text_in_user_text_is_not_the_eos_token(tok):
    ids = tok.encode(f"a{EOS}b")
    assert tok.eos_id not in ids and len(ids) > 3
    assert tok.decode(ids) == f"a{EOS}b"


@pytest.mark.parametrize("text", TRICKY)
def test_round_trip_tricky_strings(tok, text):
    assert tok.decode(tok.encode(text)) == text


@settings(max_examples=200, deadline=None)
@given(st.text())
def test_round_trip_any_string(tok, text):
    assert tok.decode(tok.encode(text)) == text


@settings(max_examples=100, deadline=None)
@given(st.text())
def test_stream_decoder_matches_decode(tok, text):
    stream = StreamDecoder(tok)
    pieces = [stream.push(i) for i in tok.encode(text)]
    assert "".join(pieces) + stream.flush() == text


def test_stream_decoder_holds_back_incomplete_characters(tok):
    ids = tok.encode("😀")  # 4 UTF-8 bytes, no merges learned for them: one id each
    assert len(ids) == 4
    stream = StreamDecoder(tok)
    assert [stream.push(i) for i in ids] == ["", "", "", "😀"]
    stream.push(ids[0])
    assert stream.flush() == "\ufffd"  # a cut-off character is replaced, not lost silently
    assert stream.push(tok.eos_id) == EOS


def test_token_bytes_agree_with_decode(tok):
    for token_id, data in enumerate(tok.token_bytes):
        assert tok.decode([token_id]) == data.decode("utf-8", errors="replace")
    assert len(set(bytes_to_unicode().values())) == 256


def test_encode_batch_equals_encode(tok):
    assert tok.encode_batch(TRICKY) == [tok.encode(t) for t in TRICKY]


def test_save_load_and_str_round_trip(tok, tmp_path):
    path = tmp_path / "tokenizer.json"
    tok.save(path)
    for other in (Tokenizer.load(path), Tokenizer.from_str(tok.to_str())):
        assert other.to_str() == tok.to_str()
        assert [other.encode(t) for t in TRICKY] == [tok.encode(t) for t in TRICKY]  # incl. EOS-as-text


def test_load_errors_name_the_file(tmp_path):
    with pytest.raises(QkvError, match="missing.json.*not found"):
        Tokenizer.load(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json", encoding="utf-8")
    with pytest.raises(QkvError, match="bad.json.*not a valid tokenizer"):
        Tokenizer.load(bad)


def test_vocab_too_small_is_rejected():
    with pytest.raises(QkvError, match="vocab_size must be an integer >= 257"):
        Tokenizer.train(["abc"], vocab_size=100)


def test_lone_surrogate_is_a_clear_error(tok):
    with pytest.raises(QkvError, match="lone surrogate at character 1"):
        tok.encode("a\ud800")
