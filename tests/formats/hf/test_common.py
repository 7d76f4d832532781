"""qkv.formats.hf.common: the activation names against transformers' own functions (ACT2FN), renaming rules both
ways (transposes, missing and unmapped tensors named), prefixes, and config.json's types checked before use."""
import pytest
import torch

from qkv.config import ModelConfig
from qkv.errors import QkvError
from qkv.formats.hf import common
from qkv.nn.ffn import ACTIVATIONS

activations = pytest.importorskip("transformers.activations")


@pytest.mark.parametrize("hf_name", sorted(common.ACTIVATIONS_FROM_HF))
def test_each_hf_activation_is_the_same_function_in_qkv(hf_name):
    x = torch.linspace(-6, 6, 1001, dtype=torch.float64)
    ours = ACTIVATIONS.get(common.activation_from_hf(hf_name, "hidden_act"))(x)
    torch.testing.assert_close(ours, activations.ACT2FN[hf_name](x), rtol=0, atol=1e-12)


@pytest.mark.parametrize("name", sorted(common.ACTIVATIONS_TO_HF))
def test_export_names_read_back_as_the_same_activation(name):
    hf_name = common.activation_to_hf(ModelConfig(activation=name))
    assert common.activation_from_hf(hf_name, "activation_function") == name


def test_activations_without_an_equivalent_are_refused_both_ways():
    with pytest.raises(QkvError, match=r"hidden_act='quick_gelu' has no qkv activation; supported: gelu, "):
        common.activation_from_hf("quick_gelu", "hidden_act")
    with pytest.raises(QkvError, match=r"model.activation='relu2' has no Hugging Face equivalent"):
        common.activation_to_hf(ModelConfig(activation="relu2"))


def test_rename_is_its_own_inverse_and_transposes_conv1d_weights():
    rules = common.block_rules(2, "blocks.", "h.", common.linear("attn.q_proj", "attn.c_q", bias=True),
                               transpose=("attn.q_proj.weight",))
    assert [r.qkv for r in rules] == ["blocks.0.attn.q_proj.weight", "blocks.0.attn.q_proj.bias",
                                      "blocks.1.attn.q_proj.weight", "blocks.1.attn.q_proj.bias"]
    ours = {r.qkv: torch.randn(3, 5) if r.transpose else torch.randn(3) for r in rules}
    theirs = common.rename(ours, rules, to_hf=True)
    assert theirs["h.1.attn.c_q.weight"].shape == (5, 3) and theirs["h.1.attn.c_q.weight"].is_contiguous()
    back = common.rename(theirs, rules, to_hf=False)
    assert back.keys() == ours.keys() and all(torch.equal(back[k], ours[k]) for k in ours)


def test_a_missing_tensor_and_an_unmapped_one_are_named():
    rules = [common.Rule("tok_emb.weight", "wte.weight")]
    with pytest.raises(QkvError, match="no tensor 'wte.weight'"):
        common.rename({}, rules, to_hf=False)
    tensors = {"wte.weight": torch.zeros(2), **{f"extra.{i}": torch.zeros(1) for i in range(5)}}
    with pytest.raises(QkvError, match=r"cannot map: extra.0, extra.1, extra.2 and 2 more"):
        common.import_tensors(tensors, rules, ignored=lambda name: False)
    kept = common.import_tensors(tensors, rules, ignored=lambda name: name.startswith("extra."))
    assert list(kept) == ["tok_emb.weight"]


def test_strip_prefix_only_when_the_probe_has_it():
    tensors = {"bert.embeddings.x": torch.zeros(1), "bert.pooler.y": torch.zeros(1)}
    assert set(common.strip_prefix(tensors, "bert.", "embeddings.x")) == {"embeddings.x", "pooler.y"}
    bare = {"embeddings.x": torch.zeros(1)}
    assert common.strip_prefix(bare, "bert.", "embeddings.x") is bare


@pytest.mark.parametrize("hf, message", [
    ({"vocab_size": True}, "vocab_size=true must be an integer"),
    ({"n_layer": 2 ** 31 + 1}, "n_layer=2147483649 must be an integer in"),
    ({"hidden_size": -1}, "hidden_size=-1 must be an integer"),
    ({"rms_norm_eps": float("nan")}, "rms_norm_eps=NaN must be a finite number"),
    ({"layer_norm_eps": "1e-5"}, "layer_norm_eps=\"1e-5\" must be a finite number"),
    ({"tie_word_embeddings": 1}, "tie_word_embeddings=1 must be true or false"),
    ({"model_type": ["gpt2"]}, "model_type=\\[\"gpt2\"\\] must be a string"),
    ({"architectures": "GPT2LMHeadModel"}, "architectures=\"GPT2LMHeadModel\" must be a list"),
    ({"eos_token_id": [1, "2"]}, "eos_token_id=\\[1, \"2\"\\] must be a token id"),
])
def test_config_values_of_the_wrong_type_are_named(hf, message):
    with pytest.raises(QkvError, match=message):
        common.check_types(hf)


def test_a_well_typed_config_passes_and_need_refuse_ensure_say_what_is_wrong():
    common.check_types({"vocab_size": 50257, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
                        "architectures": ["LlamaForCausalLM"], "eos_token_id": [1, 2], "rope_theta": None})
    with pytest.raises(QkvError, match="no 'n_embd', which this architecture needs"):
        common.need({"n_embd": None}, "n_embd")
    common.refuse({"rope_scaling": None}, "rope_scaling", None, "RoPE scaling")
    with pytest.raises(QkvError, match=r"sliding_window=4096: a sliding window is not supported by qkv \(only None\)"):
        common.refuse({"sliding_window": 4096}, "sliding_window", None, "a sliding window")
    assert common.is_zero(None) and common.is_zero(torch.zeros(3)) and not common.is_zero(torch.tensor([0, 1e-30]))
