"""qkv.formats.hf.qwen2: Qwen2ForCausalLM in (Q/K/V biases; the output projection's and the FFN's biases zeros
in qkv), logits and greedy generation equal to transformers'; written back as LLaMA with biases, which
transformers' LlamaForCausalLM runs with the same logits."""
import pytest
import torch

transformers = pytest.importorskip("transformers")

import qkv  # noqa: E402
from qkv.formats import hf  # noqa: E402
from tests.formats.hf import LENGTHS, TOL, V, check_greedy, max_diff, right_padded, save_hf  # noqa: E402


def qwen2(**kw):
    config = transformers.Qwen2Config(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                      bos_token_id=None, eos_token_id=None, **kw)
    model = transformers.Qwen2ForCausalLM(config).eval()
    with torch.no_grad():  # biases that are not zero, so that reading them is tested
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0, 0.5)
    return model


@pytest.mark.parametrize("tied", [False, True])
def test_logits_match_transformers_and_the_export_runs_as_llama(tmp_path, tied):
    model = qwen2(tie_word_embeddings=tied)
    run = qkv.load(save_hf(model, tmp_path / "hf"))
    assert run.config.model.bias and run.config.model.kv_heads == 2
    assert all(not p.any() for name, p in run.model.named_parameters() if name.endswith(("o_proj.bias", "ffn.up_proj.bias")))
    ids, mask = right_padded(2, 24, LENGTHS)
    with torch.no_grad():
        expected = model(input_ids=ids, attention_mask=mask).logits
        assert max_diff(run.model(ids, attention_mask=mask), expected, mask) <= TOL
        back = transformers.AutoModelForCausalLM.from_pretrained(hf.save(run, tmp_path / "out")).eval()
        assert type(back).__name__ == "LlamaForCausalLM"
        assert max_diff(back(input_ids=ids, attention_mask=mask).logits, expected, mask) <= TOL


def test_greedy_generation_matches_transformers(tmp_path):
    check_greedy(qwen2(), tmp_path)
