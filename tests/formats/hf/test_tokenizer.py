"""A Hugging Face tokenizer.json as a qkv Tokenizer (qkv.formats.hf.tokenizer): the ids are the `tokenizers` library's
own encoding of the same file (the oracle); the end-of-text token is found in the order the module states
(tokenizer_config's eos_token, config.json's eos_token_id, sep_token) and only its spelling changes; the
original JSON is kept and written back."""
import json

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import Whitespace

from qkv.data.tokenizer import EOS
from qkv.errors import QkvError
from qkv.formats.hf.tokenizer import eos_name, hf_tokenizer_files, read_tokenizer

WORDS = ["[PAD]", "[UNK]", "[SEP]", "</s>", "the", "king", "is", "dead", "long", "live"]
TEXT = "long live the king the king is dead"


def write_tokenizer(path, **special_files) -> HFTokenizer:
    tokenizer = HFTokenizer(WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = Whitespace()
    tokenizer.add_special_tokens(["[PAD]", "[SEP]", "</s>"])
    path.mkdir(exist_ok=True)
    tokenizer.save(str(path / "tokenizer.json"))
    for name, content in special_files.items():
        (path / f"{name}.json").write_text(json.dumps(content))
    return tokenizer


def test_ids_are_the_tokenizers_librarys_and_the_eos_is_respelled(tmp_path):
    oracle = write_tokenizer(tmp_path, tokenizer_config={"sep_token": "[SEP]"})
    tokenizer, original = read_tokenizer(tmp_path, {})
    assert tokenizer.encode(TEXT) == oracle.encode(TEXT).ids == [8, 9, 4, 5, 4, 5, 6, 7]
    assert tokenizer.eos_id == WORDS.index("[SEP]")  # the separator ends a text; its id is unchanged
    added = {entry["id"]: entry["content"] for entry in json.loads(tokenizer.to_str())["added_tokens"]}
    assert added == {0: "[PAD]", 2: EOS, 3: "</s>"}  # only its spelling changed
    assert original == (tmp_path / "tokenizer.json").read_text(encoding="utf-8")
    files = hf_tokenizer_files(tokenizer, original, 64, decoder=True)
    assert files["tokenizer.json"] == original  # written back as it came
    assert json.loads(files["tokenizer_config.json"])["eos_token"] == "[SEP]"  # named by its own spelling


def test_the_eos_is_found_in_the_stated_order(tmp_path):
    raw = json.loads(write_tokenizer(tmp_path).to_str())
    assert eos_name(tmp_path, {"eos_token_id": 3}, raw) == "</s>"  # config.json's id
    assert eos_name(tmp_path, {"eos_token_id": [3, 2]}, raw) == "</s>"  # a list: the first
    (tmp_path / "special_tokens_map.json").write_text(json.dumps({"sep_token": "[SEP]"}))
    assert eos_name(tmp_path, {}, raw) == "[SEP]"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "</s>"}}))
    assert eos_name(tmp_path, {}, raw) == "</s>"  # tokenizer_config's eos_token first
    assert eos_name(tmp_path / "x", {"eos_token_id": 99}, raw) is None  # nothing that names an added token


def test_no_tokenizer_and_not_a_tokenizer(tmp_path):
    assert read_tokenizer(tmp_path, {}) == (None, None)
    (tmp_path / "tokenizer.json").write_text('{"version": "1.0"}')
    with pytest.raises(QkvError, match="not a tokenizers JSON file"):
        read_tokenizer(tmp_path, {})
