"""qkv.formats.chat: a model dir's chat read wherever transformers reads it (chat_template.jinja, the named or
plain chat_template of tokenizer_config.json), its BOS text, and the ids that end a turn."""
import json

import pytest

from qkv.errors import QkvError
from qkv.formats.chat import read_chat

MESSAGES = [{"role": "user", "content": "hi"}]


def test_named_templates_take_default_and_a_malformed_one_is_one_error(tmp_path):
    config = tmp_path / "tokenizer_config.json"
    config.write_text(json.dumps({"chat_template": [{"name": "tool_use", "template": "T"},
                                                    {"name": "default", "template": "D{{ bos_token }}"}],
                                  "bos_token": {"content": "<s>"}}))
    chat = read_chat(tmp_path, {})
    assert chat.template == "D{{ bos_token }}" and chat.bos_token == "<s>"
    config.write_text(json.dumps({"chat_template": 7}))
    with pytest.raises(QkvError, match="chat_template must be a string"):
        read_chat(tmp_path, {})


def test_chat_template_jinja_wins_and_turns_end_at_the_generation_configs_eos(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "old", "bos_token": "<s>"}))
    (tmp_path / "chat_template.jinja").write_text("{{ messages[0].content }}")
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7, 2]}))
    chat = read_chat(tmp_path, {"eos_token_id": 5}, vocab_size=10)
    assert chat.template == "{{ messages[0].content }}" and chat.stop_ids == (2, 7)
    (tmp_path / "generation_config.json").unlink()
    assert read_chat(tmp_path, {"eos_token_id": 5}, vocab_size=10).stop_ids == (5,)
    assert read_chat(tmp_path, {"eos_token_id": 50}, vocab_size=10).stop_ids == ()  # not a token of this model
