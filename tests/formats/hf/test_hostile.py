"""Hugging Face dirs that lie: shards outside the dir, config values of the wrong type, a tokenizer bigger than
the model. Each is one `qkv: error:` line (exit 2) from `qkv.load`'s users, never a traceback or a read of
another file."""
import json

import pytest
import transformers
from safetensors.torch import load_file, save_file

import qkv
from qkv.errors import QkvError
from tests.formats.hf import save_hf
from tests.formats.hf.test_files import bpe


def gpt2(tmp_path, **config):
    cfg = transformers.GPT2Config(vocab_size=bpe().vocab_size, n_positions=32, n_embd=16, n_layer=1, n_head=2,
                                  **config)
    return save_hf(transformers.GPT2LMHeadModel(cfg), tmp_path / "gpt2")


def test_a_shard_outside_the_model_dir_is_never_read(tmp_path):
    path = gpt2(tmp_path)
    outside = tmp_path / "outside.safetensors"
    save_file(load_file(str(path / "model.safetensors")), str(outside))
    (path / "model.safetensors").unlink()
    names = list(load_file(str(outside)))
    (path / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {name: "../outside.safetensors" for name in names}}))
    with pytest.raises(QkvError, match="not a .safetensors file in"):
        qkv.load(path)
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {names[0]: "/etc/passwd"}}))
    with pytest.raises(QkvError, match="not a .safetensors file in"):
        qkv.load(path)


@pytest.mark.parametrize("field, value", [("tie_word_embeddings", "yes"), ("n_layer", "2"), ("n_embd", 16.5),
                                          ("n_positions", None), ("layer_norm_epsilon", [1e-5])])
def test_config_values_of_the_wrong_type_are_refused(tmp_path, field, value):
    path = gpt2(tmp_path)
    raw = json.loads((path / "config.json").read_text())
    raw[field] = value
    (path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(QkvError):
        qkv.load(path)


def test_a_tokenizer_bigger_than_the_models_vocabulary_is_refused_at_load(tmp_path):
    path = tmp_path / "small"
    cfg = transformers.GPT2Config(vocab_size=100, n_positions=32, n_embd=16, n_layer=1, n_head=2)
    save_hf(transformers.GPT2LMHeadModel(cfg), path)
    bpe().save(path / "tokenizer.json")  # 300 tokens for a model with 100 rows
    with pytest.raises(QkvError, match="more than the model's vocab_size=100"):
        qkv.load(path)
