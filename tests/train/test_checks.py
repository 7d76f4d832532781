"""check_run / check_model: every name by the registry that owns it, the chosen entries' facts against the
sizes, one line naming the field; and config.py stays a leaf that validates without torch."""
import subprocess
import sys

import pytest

from qkv.train.checks import NAMED, check_run
from qkv.config import DataConfig, ModelConfig, ParallelConfig, RunConfig, TrainConfig
from qkv.errors import QkvError
from qkv.models.build import check_model
from qkv.nn import registries
from qkv.nn.kernels import KERNELS
from qkv.nn.positional import POSITIONALS


def error_of(make) -> str:
    with pytest.raises(QkvError) as info:
        make()
    message = str(info.value)
    assert "\n" not in message
    return message


def test_defaults_pass_and_check_run_returns_the_config():
    cfg = RunConfig()
    assert check_run(cfg) is cfg and check_model(cfg.model) is cfg.model


@pytest.mark.parametrize("axis", sorted(registries.AXES))
def test_unknown_model_names_list_the_registry_choices(axis):
    message = error_of(lambda: check_model(ModelConfig(**{axis: "bogus"})))
    assert message == f"model.{axis}='bogus' is not allowed; choose from: " + ", ".join(registries.get(axis).names())


@pytest.mark.parametrize("fields, expected", [
    (dict(arch="gpt"), "model.arch='gpt' is not allowed; choose from: decoder, encoder, encoder-decoder"),
    (dict(arch="encoder", head="pooler"), "model.head='pooler' is not allowed; choose from: classifier, mlm, none"),
    (dict(pooling="max"), "model.pooling='max' is not allowed; choose from: first, mean"),
    (dict(d_model=12, n_heads=4, positional="rope"), "model.positional='rope' needs an even head width, got 3"),
    (dict(attention="local"), "model.attention='local' needs model.window >= 1, got 0"),
])
def test_model_names_and_entry_facts(fields, expected):
    assert error_of(lambda: check_model(ModelConfig(**fields))) == expected


def test_entry_facts_are_read_from_the_entries():
    """Every windowed kernel needs a window and every even-width encoding an even head: no list elsewhere."""
    for name in KERNELS.names():
        cfg = ModelConfig(attention=name, window=0)
        if KERNELS.get(name).windowed:
            assert "needs model.window >= 1" in error_of(lambda: check_model(cfg))
        else:
            check_model(cfg)
    odd = dict(d_model=12, n_heads=4)  # Dh = 3
    for name in POSITIONALS.names():
        cfg = ModelConfig(positional=name, **odd)
        if POSITIONALS.get(name).even_head_dim:
            assert "even head width" in error_of(lambda: check_model(cfg))
        else:
            check_model(cfg)


@pytest.mark.parametrize("key", sorted(NAMED))
def test_every_named_field_of_train_data_parallel_lists_its_registry(key):
    section, name = key.split(".")
    cfg = RunConfig(**{section: type(getattr(RunConfig(), section))(**{name: "bogus"})})
    assert error_of(lambda: check_run(cfg)) == (
        f"{key}='bogus' is not allowed; choose from: " + ", ".join(NAMED[key].names()))


@pytest.mark.parametrize("cfg, expected", [
    (RunConfig(train=TrainConfig(objective="clm")),
     "train.objective='clm' is not allowed; choose from: auto, classify, dpo, lm, mlm, seq2seq, sft"),
    (RunConfig(data=DataConfig(spelling="old")), "data.spelling='old' is not allowed; choose from: modern, first-folio"),
    (RunConfig(data=DataConfig(corpus="wiki")), "data.corpus='wiki' is not allowed; choose from: shakespeare"),
    (RunConfig(parallel=ParallelConfig(schedule="zb")),
     "parallel.schedule='zb' is not allowed; choose from: 1f1b, gpipe"),
    (RunConfig(train=TrainConfig(lr_scaling="cubic")),
     "train.lr_scaling='cubic' is not allowed; choose from: linear, none, sqrt"),
    (RunConfig(parallel=ParallelConfig(zero=9)), "parallel.zero=9 is not allowed; choose from: 0, 1, 2, 3"),
])
def test_check_run_messages(cfg, expected):
    assert error_of(lambda: check_run(cfg)) == expected


def test_config_is_a_leaf_that_validates_without_torch():
    """config.py imports only qkv.errors, its value rules (qkv.config_values, a leaf), the model fields'
    combination rules (qkv.config_rules, a leaf) and the JSON reader of qkv.files; validating every section imports
    neither torch nor another qkv module."""
    code = ("import sys; from qkv.config import RunConfig; RunConfig().validate(); "
            "mods = sorted(m for m in sys.modules if m.startswith('qkv') or m == 'torch'); print(mods)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "['qkv', 'qkv.config', 'qkv.config_rules', 'qkv.config_values', 'qkv.errors', 'qkv.files']"
