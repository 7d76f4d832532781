"""Property-based (hypothesis): whatever a user types or a file holds, qkv's checks answer with a QkvError
(the CLI's exit 2 and one line) or accept it; no other exception escapes. Three inputs a person controls:
--set overrides of any field with any text, train_state.json edited by hand, and an HF config.json's values."""
import dataclasses
import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from qkv import presets
from qkv.train.checks import check_run
from qkv.config import SECTIONS
from qkv.errors import QkvError
from qkv.formats.hf import detect
from qkv.models.build import check_model
from qkv.train import checkpoint

FIELDS = [f"{name}.{f.name}" for name, cls in SECTIONS.items() for f in dataclasses.fields(cls)]
TEXTS = st.one_of(st.integers(-10 ** 25, 10 ** 25).map(str), st.floats(allow_nan=True).map(repr),
                  st.sampled_from(["inf", "-inf", "nan", "", "true", "null", "[]", "1e400", "0x10", "gpt", "rope"]),
                  st.text(max_size=12))
JSON_VALUES = st.recursive(st.none() | st.booleans() | st.integers(-10 ** 20, 10 ** 20) | st.floats() |
                           st.text(max_size=8), lambda inner: st.lists(inner, max_size=3) |
                           st.dictionaries(st.text(max_size=5), inner, max_size=3), max_leaves=6)
FAST = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def accepted_or_refused(fn) -> None:
    try:
        fn()
    except QkvError:
        pass


@FAST
@given(st.lists(st.tuples(st.sampled_from(FIELDS), TEXTS), min_size=1, max_size=3))
def test_any_set_override_is_accepted_or_refused(assignments):
    cfg = presets.get("tiny")
    accepted_or_refused(lambda: check_run(cfg.override([f"{key}={text}" for key, text in assignments]).validate()))


STATE_KEYS = ["step", "trainer", "optimizer", "scaler"] + [f"trainer.{name}" for name in checkpoint.TRAINER_FIELDS]


@FAST
@given(st.lists(st.tuples(st.sampled_from(STATE_KEYS), JSON_VALUES), min_size=1, max_size=3))
def test_any_edit_of_train_state_json_is_accepted_or_refused(tmp_path_factory, edits):
    raw = {"step": 4, "trainer": dataclasses.asdict(checkpoint.State(step=4)), "optimizer": [{"params": [0, 1]}]}
    for key, value in edits:
        section, _, name = key.partition(".")
        if name and isinstance(raw.get(section), dict):
            raw[section][name] = value
        else:
            raw[section] = value
    raw = json.loads(json.dumps(raw))  # as the file would hold it
    accepted_or_refused(lambda: checkpoint.check_state_json(raw, tmp_path_factory.getbasetemp() / "s.json"))


GPT2 = {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "vocab_size": 100, "n_positions": 32,
        "n_embd": 16, "n_layer": 2, "n_head": 2, "layer_norm_epsilon": 1e-5, "activation_function": "gelu_new",
        "tie_word_embeddings": True}


LLAMA = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 100, "hidden_size": 16,
         "intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
         "max_position_embeddings": 32, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "hidden_act": "silu"}
T5 = {"model_type": "t5", "architectures": ["T5ForConditionalGeneration"], "vocab_size": 100, "d_model": 16,
      "d_kv": 8, "d_ff": 32, "num_layers": 1, "num_heads": 2, "relative_attention_num_buckets": 32,
      "relative_attention_max_distance": 128, "feed_forward_proj": "relu"}
BASES = [GPT2, LLAMA, T5]
KEYS = sorted({key for base in BASES for key in base} | {"n_inner", "rope_scaling", "head_dim", "eos_token_id"})


@FAST
@given(st.sampled_from(BASES), st.lists(st.tuples(st.sampled_from(KEYS), JSON_VALUES), min_size=1, max_size=3))
def test_any_hf_config_value_is_accepted_or_refused(base, edits):
    hf = {**base, **dict(edits)}

    def read():
        family, architecture = detect(hf)
        check_model(family.config(hf, architecture))

    accepted_or_refused(read)


def test_the_properties_can_fail():
    """The harness lets every exception but QkvError through (else the properties above prove nothing)."""
    with pytest.raises(ZeroDivisionError):
        accepted_or_refused(lambda: 1 / 0)
