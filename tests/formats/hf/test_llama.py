"""qkv.formats.hf.llama: LlamaForCausalLM in and out (RMSNorm, RoPE with its theta, SwiGLU, grouped K/V heads,
optional biases and tying), logits and greedy generation equal to transformers'."""
import pytest

transformers = pytest.importorskip("transformers")

from tests.formats.hf import V, check_decoder, check_greedy  # noqa: E402


def llama_config(**kw):
    return transformers.LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                    num_attention_heads=4, max_position_embeddings=32, bos_token_id=None,
                                    eos_token_id=None, **kw)


MODELS = {
    "llama-gqa-untied": lambda: transformers.LlamaForCausalLM(llama_config(
        num_key_value_heads=2, rope_parameters={"rope_type": "default", "rope_theta": 500.0})),
    "llama-mha-tied-bias": lambda: transformers.LlamaForCausalLM(llama_config(
        num_key_value_heads=4, tie_word_embeddings=True, attention_bias=True, mlp_bias=True)),
}


@pytest.mark.parametrize("name", MODELS)
def test_logits_match_transformers(name, tmp_path):
    check_decoder(MODELS[name](), tmp_path)


def test_greedy_generation_matches_transformers(tmp_path):
    check_greedy(MODELS["llama-gqa-untied"](), tmp_path)
