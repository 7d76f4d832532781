import dataclasses
import json

import pytest

from qkv.config import DataConfig, ModelConfig, ParallelConfig, RunConfig, TrainConfig
from qkv.errors import QkvError

# Names (model.norm, train.schedule, data.split, ...) are checked by their registries: tests/test_checks.py.


def error_of(make) -> str:
    with pytest.raises(QkvError) as info:
        make()
    message = str(info.value)
    assert "\n" not in message  # one line, for people (STYLE.md 14)
    return message


# ------------------------------------------------------------------------------------------ dataclass basics


def test_configs_are_frozen_and_keyword_only():
    with pytest.raises(TypeError):
        ModelConfig(256)  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        ModelConfig().d_model = 3  # type: ignore[misc]


def test_derived_sizes():
    cfg = ModelConfig(d_model=96, n_heads=6, n_kv_heads=0, n_layers=3)
    assert (cfg.head_dim, cfg.kv_heads, cfg.encoder_layers, cfg.decoder_layers) == (16, 6, 3, 3)
    cfg = ModelConfig(d_model=96, n_heads=6, n_kv_heads=2, n_layers=3, n_encoder_layers=4, n_decoder_layers=5)
    assert (cfg.kv_heads, cfg.encoder_layers, cfg.decoder_layers) == (2, 4, 5)


def test_defaults_validate_and_validate_returns_self():
    for cfg in (ModelConfig(), DataConfig(), ParallelConfig()):
        assert cfg.validate() is cfg


@pytest.mark.parametrize("kv_heads", [0, 1, 2, 4])
def test_mha_gqa_mqa_head_counts_are_valid(kv_heads):
    ModelConfig(d_model=32, n_heads=4, n_kv_heads=kv_heads).validate()


# ------------------------------------------------------------------------------------------ validation errors

MODEL_ERRORS = [
    (dict(vocab_size=0), "model.vocab_size=0 must be positive"),
    (dict(d_model=-8), "model.d_model=-8 must be positive"),
    (dict(n_heads=0), "model.n_heads=0 must be positive"),
    (dict(n_layers=0), "model.n_layers=0 must be positive"),
    (dict(d_ff=0), "model.d_ff=0 must be positive"),
    (dict(max_seq_len=0), "model.max_seq_len=0 must be positive"),
    (dict(n_kv_heads=-1), "model.n_kv_heads=-1 must be at least 0"),
    (dict(n_encoder_layers=-1), "model.n_encoder_layers=-1 must be at least 0"),
    (dict(n_decoder_layers=-1), "model.n_decoder_layers=-1 must be at least 0"),
    (dict(moe_experts=-2), "model.moe_experts=-2 must be at least 0"),
    (dict(window=-1), "model.window=-1 must be at least 0"),
    (dict(d_model=30, n_heads=4), "model.d_model=30 must be divisible by model.n_heads=4 (or set model.head_size)"),
    (dict(head_size=-2), "model.head_size=-2 must be at least 0"),
    (dict(n_layers=3, layer_types=("global", "sliding")), "model.layer_types has 2 entries for 3 layers: one per layer"),
    (dict(n_layers=2, layer_types=("global", "sliding")),
     "model.layer_types has sliding layers: model.sliding_window must be >= 1, got 0"),
    (dict(arch="encoder", n_layers=1, layer_types=("global",)),
     "model.layer_types needs model.arch='decoder', got model.arch='encoder'"),
    (dict(rope_factor=0.0), "model.rope_factor=0.0 must be positive"),
    (dict(d_model=32, n_heads=4, positional="rope", rope_scaling="longrope", rope_original_context=8,
          rope_long_factors=(2.0,) * 3, rope_short_factors=(1.0,) * 4),
     "model.rope_long_factors / rope_short_factors have 3 / 4 entries: longrope needs one a turned pair, 4"),
    (dict(d_model=32, n_heads=4, rope_dims=3), "model.rope_dims=3 must be an even number in 2..head_dim=8 (or 0: all)"),
    (dict(rope_long_factors=(1.0, float("inf"))), "model.rope_long_factors=(1.0, inf) must be finite numbers"),
    (dict(attn_softcap=-1.0), "model.attn_softcap=-1.0 must be at least 0"),
    (dict(d_model=32, n_heads=4, n_kv_heads=3), "model.n_kv_heads=3 must divide model.n_heads=4"),
    (dict(d_model=32, n_heads=4, n_kv_heads=8), "model.n_kv_heads=8 must divide model.n_heads=4"),
    (dict(moe_experts=4, moe_top_k=5), "model.moe_top_k=5 must be in 1..model.moe_experts=4"),
    (dict(moe_experts=4, moe_top_k=0), "model.moe_top_k=0 must be in 1..model.moe_experts=4"),
    (dict(dropout=1.0), "model.dropout=1.0 must be in [0, 1)"),
    (dict(dropout=-0.1), "model.dropout=-0.1 must be in [0, 1)"),
    (dict(norm_eps=0.0), "model.norm_eps=0.0 must be positive"),
    (dict(init_std=-0.02), "model.init_std=-0.02 must be positive"),
    (dict(rope_theta=0.0), "model.rope_theta=0.0 must be positive"),
    (dict(max_distance=0), "model.max_distance=0 must be positive"),
    (dict(moe_capacity_factor=-1.0), "model.moe_capacity_factor=-1.0 must be at least 0"),
    (dict(logit_softcap=-1.0), "model.logit_softcap=-1.0 must be at least 0"),
    (dict(bigram_vocab=1), "model.bigram_vocab=1 must be 0 (none) or at least 2 rows"),
    (dict(bigram_vocab=-4), "model.bigram_vocab=-4 must be 0 (none) or at least 2 rows"),
    (dict(arch="encoder-decoder", bigram_vocab=64), "model.bigram_vocab=64 needs model.arch='decoder', "
                                                    "got model.arch='encoder-decoder'"),
    (dict(arch="encoder", logit_softcap=30.0), "model.logit_softcap=30.0 needs model.arch='decoder', "
                                               "got model.arch='encoder'"),
]


@pytest.mark.parametrize("fields, expected", MODEL_ERRORS, ids=[m.split("=")[0] + str(i) for i, (_, m) in
                                                               enumerate(MODEL_ERRORS)])
def test_model_validation_names_the_field_the_value_and_the_rule(fields, expected):
    assert error_of(lambda: ModelConfig(**fields).validate()) == expected


def test_names_are_left_to_their_registries():
    """validate() checks what the config can alone: an unknown name passes here, check_run refuses it."""
    assert ModelConfig(norm="bogus", attention="bogus").validate()
    assert TrainConfig(schedule="bogus").validate() and DataConfig(split="bogus").validate()


def test_moe_top_k_is_ignored_for_a_dense_ffn():
    ModelConfig(moe_experts=0, moe_top_k=99).validate()


DATA_ERRORS = [
    (dict(vocab_size=0), "data.vocab_size=0 must be positive"),
    (dict(vocab_size=256), "data.vocab_size=256 must be at least 257 (256 bytes + end of text)"),
    (dict(val_fraction=0.0), "data.val_fraction=0.0 must be in (0, 1)"),
    (dict(val_fraction=1.0), "data.val_fraction=1.0 must be in (0, 1)"),
]

PARALLEL_ERRORS = [
    (dict(dp=0), "parallel.dp=0 must be positive"),
    (dict(tp=0), "parallel.tp=0 must be positive"),
    (dict(pp=-1), "parallel.pp=-1 must be positive"),
    (dict(zero=4), "parallel.zero=4 is not allowed; choose from: 0, 1, 2, 3"),
]


@pytest.mark.parametrize("cls, fields, expected", [(DataConfig, f, m) for f, m in DATA_ERRORS]
                         + [(ParallelConfig, f, m) for f, m in PARALLEL_ERRORS])
def test_data_and_parallel_validation_messages(cls, fields, expected):
    assert error_of(lambda: cls(**fields).validate()) == expected


STAGES = "must divide train.seq_len=128: the ramp's lengths are its multiples"
TRAIN_ERRORS = [
    (dict(batch_size=0), "train.batch_size=0 must be positive"),
    (dict(seq_len=0), "train.seq_len=0 must be positive"),
    (dict(max_steps=0), "train.max_steps=0 must be positive"),
    (dict(accumulation=0), "train.accumulation=0 must be positive"),
    (dict(eval_batches=0), "train.eval_batches=0 must be positive"),
    (dict(log_every=0), "train.log_every=0 must be positive"),
    (dict(max_time=-1.0), "train.max_time=-1.0 must be at least 0"),
    (dict(warmup_steps=-1), "train.warmup_steps=-1 must be at least 0"),
    (dict(weight_decay=-0.1), "train.weight_decay=-0.1 must be at least 0"),
    (dict(grad_clip=-1.0), "train.grad_clip=-1.0 must be at least 0"),
    (dict(min_lr=-1e-4), "train.min_lr=-0.0001 must be at least 0"),
    (dict(lr=0.0), "train.lr=0.0 must be positive"),
    (dict(eps=0.0), "train.eps=0.0 must be positive"),
    (dict(beta1=1.0), "train.beta1=1.0 must be in [0, 1)"),
    (dict(beta2=-0.5), "train.beta2=-0.5 must be in [0, 1)"),
    (dict(label_smoothing=1.0), "train.label_smoothing=1.0 must be in [0, 1)"),
    (dict(batch_size=10, accumulation=3), "train.accumulation=3 must divide train.batch_size=10"),
    (dict(precision="fp8"), "train.precision='fp8' is not allowed; choose from: auto, fp32, bf16, fp16"),
    (dict(max_bad_steps=0), "train.max_bad_steps=0 must be positive"),
    (dict(spike_window=0), "train.spike_window=0 must be positive"),
    (dict(loss_scale_window=0), "train.loss_scale_window=0 must be positive"),
    (dict(batch_warmup_steps=-1), "train.batch_warmup_steps=-1 must be at least 0"),
    (dict(base_batch=-8), "train.base_batch=-8 must be at least 0"),
    (dict(spike_factor=-1.0), "train.spike_factor=-1.0 must be at least 0"),
    (dict(spike_factor=0.5), "train.spike_factor=0.5 must be above 1 (or 0 to disable)"),
    (dict(batch_warmup_start=0), "train.batch_warmup_start=0 must be in 1..train.batch_size=16"),
    (dict(batch_warmup_start=17), "train.batch_warmup_start=17 must be in 1..train.batch_size=16"),
    (dict(seq_warmup_steps=-1), "train.seq_warmup_steps=-1 must be at least 0"),
    (dict(seq_warmup_steps=10, seq_warmup_start=48), f"train.seq_warmup_start=48 {STAGES}"),
    (dict(seq_warmup_steps=10, seq_warmup_start=0), f"train.seq_warmup_start=0 {STAGES}"),
]


@pytest.mark.parametrize("fields, expected", TRAIN_ERRORS)
def test_train_validation_messages(fields, expected):
    assert TrainConfig().validate() == TrainConfig()
    assert error_of(lambda: TrainConfig(**fields).validate()) == expected


def test_run_config_validates_every_section():
    assert RunConfig().validate() == RunConfig()
    assert "parallel.zero" in error_of(lambda: RunConfig(parallel=ParallelConfig(zero=9)).validate())


# ------------------------------------------------------------------------------------------ JSON round trip


def custom_run_config() -> RunConfig:
    return RunConfig(
        model=ModelConfig(d_model=64, n_heads=8, n_kv_heads=2, positional="rope", norm="rmsnorm",
                          tie_embeddings=False, dropout=0.1, rope_theta=500000.0),
        train=TrainConfig(lr=3e-4, max_steps=7, activation_checkpointing=True, precision="bf16"),
        data=DataConfig(paths=("a.txt", "dir/b"), spelling="first-folio", val_fraction=0.25),
        parallel=ParallelConfig(dp=2, zero=3),
    )


def test_to_dict_is_plain_json_and_round_trips_exactly(tmp_path):
    cfg = custom_run_config()
    raw = json.loads(json.dumps(cfg.to_dict()))
    assert list(raw) == ["model", "train", "data", "parallel"]
    assert raw["data"]["paths"] == ["a.txt", "dir/b"] and raw["model"]["tie_embeddings"] is False
    assert RunConfig.from_dict(raw) == cfg
    path = tmp_path / "config.json"
    cfg.save(path)
    loaded = RunConfig.load(path)
    assert loaded == cfg and isinstance(loaded.data.paths, tuple)
    assert isinstance(loaded.model.rope_theta, float) and isinstance(loaded.train.max_steps, int)


def test_from_dict_fills_missing_sections_and_fields_with_defaults():
    cfg = RunConfig.from_dict({"model": {"d_model": 32}})
    assert cfg == RunConfig(model=ModelConfig(d_model=32))


def test_from_dict_accepts_an_int_for_a_float_and_stores_a_float():
    cfg = RunConfig.from_dict({"train": {"lr": 1}})
    assert cfg.train.lr == 1.0 and type(cfg.train.lr) is float


@pytest.mark.parametrize("section, key, value, expected", [
    ("model", "d_model", 1.5, "model.d_model=1.5 has the wrong type; expected int"),
    ("model", "d_model", "64", "model.d_model='64' has the wrong type; expected int"),
    ("model", "d_model", True, "model.d_model=True has the wrong type; expected int"),
    ("model", "tie_embeddings", 1, "model.tie_embeddings=1 has the wrong type; expected bool"),
    ("train", "lr", "0.1", "train.lr='0.1' has the wrong type; expected float"),
    ("train", "lr", False, "train.lr=False has the wrong type; expected float"),
    ("model", "norm", 3, "model.norm=3 has the wrong type; expected str"),
    ("data", "paths", "a.txt", "data.paths='a.txt' has the wrong type; expected list of strings"),
    ("data", "paths", ["a", 1], "data.paths=['a', 1] has the wrong type; expected list of strings"),
])
def test_from_dict_type_errors_name_the_field_and_the_expected_type(section, key, value, expected):
    assert error_of(lambda: RunConfig.from_dict({section: {key: value}})) == expected


def test_from_dict_unknown_keys_list_the_choices():
    message = error_of(lambda: RunConfig.from_dict({"modle": {}}, origin="x.json"))
    assert message == "x.json: unknown key 'modle'; choose from: model, train, data, parallel"
    message = error_of(lambda: RunConfig.from_dict({"parallel": {"ddp": 2}}, origin="x.json"))
    assert message == "x.json: parallel: unknown key 'ddp'; choose from: dp, tp, pp, zero, ep, schedule, microbatches"


def test_from_dict_rejects_non_objects():
    assert "expected a JSON object" in error_of(lambda: RunConfig.from_dict([1, 2]))
    assert error_of(lambda: RunConfig.from_dict({"model": 3})) == "config: section 'model' must be a JSON object"


def test_load_errors_name_the_file(tmp_path):
    missing = tmp_path / "nope.json"
    assert error_of(lambda: RunConfig.load(missing)) == f"{missing}: no such file"
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    assert error_of(lambda: RunConfig.load(broken)).startswith(f"{broken}: not valid JSON")
    assert "is a directory" in error_of(lambda: RunConfig.load(tmp_path))
    wrong = tmp_path / "wrong.json"
    wrong.write_text(json.dumps({"model": {"d_model": "big"}}))
    assert error_of(lambda: RunConfig.load(wrong)) == "model.d_model='big' has the wrong type; expected int"


# ------------------------------------------------------------------------------------------ --set overrides


@pytest.mark.parametrize("text, expected", [
    ("model.tie_embeddings=false", False), ("model.tie_embeddings=False", False),
    ("model.tie_embeddings=0", False), ("model.tie_embeddings=true", True),
    ("model.tie_embeddings=TRUE", True), ("model.tie_embeddings=1", True),
])
def test_override_parses_bools(text, expected):
    value = RunConfig(model=ModelConfig(tie_embeddings=not expected)).override([text]).model.tie_embeddings
    assert value is expected


def test_override_parses_each_field_to_its_type():
    cfg = RunConfig().override([
        "model.d_model=256", "train.lr=3e-4", "train.max_time=60", "model.norm=rmsnorm",
        "data.paths=a.txt,b/c.txt", " parallel.zero = 2 ",
    ])
    assert cfg.model.d_model == 256 and type(cfg.model.d_model) is int
    assert cfg.train.lr == 3e-4 and type(cfg.train.lr) is float
    assert cfg.train.max_time == 60.0 and type(cfg.train.max_time) is float
    assert cfg.model.norm == "rmsnorm"
    assert cfg.data.paths == ("a.txt", "b/c.txt")
    assert cfg.parallel.zero == 2
    untouched = dataclasses.replace(cfg.model, d_model=128, norm="layernorm")
    assert untouched == ModelConfig()  # nothing else changed


def test_override_is_pure_and_later_assignments_win():
    base = RunConfig()
    cfg = base.override(["model.n_layers=3", "model.n_layers=5"])
    assert cfg.model.n_layers == 5 and base.model.n_layers == 2


def test_override_value_may_contain_equals_and_an_empty_list_clears_paths():
    assert RunConfig().override(["data.paths=a=b.txt"]).data.paths == ("a=b.txt",)
    assert RunConfig(data=DataConfig(paths=("x",))).override(["data.paths="]).data.paths == ()


@pytest.mark.parametrize("text, expected", [
    ("model.tie_embeddings=yes", "model.tie_embeddings='yes' is not a valid bool"),
    ("model.d_model=1.5", "model.d_model='1.5' is not a valid int"),
    ("model.d_model=", "model.d_model='' is not a valid int"),
    ("train.lr=fast", "train.lr='fast' is not a valid float"),
])
def test_override_bad_values_name_the_field_and_type(text, expected):
    assert error_of(lambda: RunConfig().override([text])) == expected


def test_override_unknown_section_or_field_lists_the_choices():
    assert error_of(lambda: RunConfig().override(["optim.lr=1"])) == (
        "--set: unknown key 'optim'; choose from: model, train, data, parallel")
    message = error_of(lambda: RunConfig().override(["parallel.ddp=2"]))
    assert message == "--set parallel: unknown key 'ddp'; choose from: dp, tp, pp, zero, ep, schedule, microbatches"
    message = error_of(lambda: RunConfig().override(["model.dmodel=2"]))
    assert message.startswith("--set model: unknown key 'dmodel'; choose from: arch, vocab_size, d_model,")
    assert all(f.name in message for f in dataclasses.fields(ModelConfig))


@pytest.mark.parametrize("text", ["model.d_model", "d_model=3", "=3"])
def test_override_malformed_assignment_shows_the_expected_form(text):
    assert "expected section.field=value" in error_of(lambda: RunConfig().override([text]))
