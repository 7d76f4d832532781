"""The open models of 2024-25 from Hugging Face dirs, each a tiny random model built with transformers' own class:
Llama 3.x with its scaled RoPE (llama3, linear, yarn), Qwen3 (q/k norms, head_dim apart from D / H), Gemma 2
(alternating windows, soft-capped scores and logits), Gemma 3 (five sliding layers to one global, two RoPE
bases, four norms a block), Mistral (every layer sliding), SmolLM3 (NoPE layers), Phi-3 (fused q/k/v and
gate/up, every layer sliding). Logits on right-padded rows within 1e-5 of
transformers' in fp32, written back where qkv writes the family, and greedy generation token for token.
Sizes exercise what differs: head_dim not D / H, GQA, windows shorter than the rows, 6+ layers for Gemma 3."""
import pytest
import torch

import qkv

transformers = pytest.importorskip("transformers")

from tests.formats.hf import V, check_decoder, check_greedy, cli, perturbed, save_hf  # noqa: E402

SMALL = dict(vocab_size=V, hidden_size=32, intermediate_size=48, num_attention_heads=4, max_position_embeddings=64,
             bos_token_id=None, eos_token_id=None, pad_token_id=None)


def llama(rope):
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        **SMALL, num_hidden_layers=2, num_key_value_heads=2, rope_parameters=rope))


def qwen3():
    return transformers.Qwen3ForCausalLM(transformers.Qwen3Config(
        **SMALL, num_hidden_layers=2, num_key_value_heads=2, head_dim=12, tie_word_embeddings=False))


def gemma3(window=5):
    return transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(
        **SMALL, num_hidden_layers=7, num_key_value_heads=2, head_dim=16, sliding_window=window,
        query_pre_attn_scalar=20, rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                                                   "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}))


def gemma2():
    return transformers.Gemma2ForCausalLM(transformers.Gemma2Config(
        **SMALL, num_hidden_layers=4, num_key_value_heads=1, head_dim=8, sliding_window=6, query_pre_attn_scalar=8,
        attn_logit_softcapping=3.0, final_logit_softcapping=2.0))


def mistral():
    return transformers.MistralForCausalLM(transformers.MistralConfig(
        **SMALL, num_hidden_layers=2, num_key_value_heads=2, sliding_window=7))


def smollm3():
    return transformers.SmolLM3ForCausalLM(transformers.SmolLM3Config(
        **SMALL, num_hidden_layers=4, num_key_value_heads=2,
        no_rope_layer_interval=2))  # layers 2 and 4 nope


def phi3(partial: float = 1.0, **extra):
    return transformers.Phi3ForCausalLM(transformers.Phi3Config(
        **{**SMALL, "sliding_window": 6, **extra}, num_hidden_layers=2, num_key_value_heads=2,
        tie_word_embeddings=False, partial_rotary_factor=partial))


def phi3_longrope():
    """Phi-3 128k's kind: divisors a pair, short within the original 16 positions and long past them."""
    generator = torch.Generator().manual_seed(5)
    long, short = (1.0 + 3.0 * torch.rand(4, generator=generator), 1.0 + 0.5 * torch.rand(4, generator=generator))
    return phi3(max_position_embeddings=64, original_max_position_embeddings=16, sliding_window=None,
                rope_parameters={"rope_type": "longrope", "rope_theta": 100.0, "long_factor": long.tolist(),
                                 "short_factor": short.tolist(), "original_max_position_embeddings": 16})


MODELS = {
    "llama3-rope": lambda: llama({"rope_type": "llama3", "rope_theta": 500.0, "factor": 8.0, "low_freq_factor": 1.0,
                                  "high_freq_factor": 4.0, "original_max_position_embeddings": 16}),
    "linear-rope": lambda: llama({"rope_type": "linear", "rope_theta": 100.0, "factor": 4.0}),
    "yarn-rope": lambda: llama({"rope_type": "yarn", "rope_theta": 100.0, "factor": 4.0,
                                "original_max_position_embeddings": 16}),
    "qwen3": qwen3,
    "gemma3": gemma3,
    "gemma2": gemma2,
    "mistral": mistral,
    "smollm3": smollm3,
    "phi3": phi3,
    "phi4-mini-partial": lambda: phi3(partial=0.75),  # each head turns 6 of its 8 dimensions
}
READ_ONLY = {"phi3", "phi4-mini-partial"}  # written as another family (Mistral: the same function, unfused)


@pytest.mark.parametrize("name", MODELS)
def test_logits_match_transformers(name, tmp_path):
    torch.manual_seed(0)
    check_decoder(perturbed(MODELS[name]()), tmp_path, export=name not in READ_ONLY)


@pytest.mark.parametrize("name", ["gemma3", "qwen3", "llama3-rope", "gemma2", "smollm3", "phi3", "phi4-mini-partial"])
def test_greedy_generation_matches_transformers(name, tmp_path):
    torch.manual_seed(1)
    check_greedy(perturbed(MODELS[name]()), tmp_path)


def test_a_partial_rotation_is_not_written_as_a_family_that_turns_every_dimension(tmp_path):
    """LLaMA and Mistral turn every dimension of a head: writing Phi-4-mini's kind as one would change its function."""
    save_hf(perturbed(phi3(partial=0.75)), tmp_path / "hf")
    assert qkv.load(tmp_path / "hf").config.model.rope_dims == 6
    for flag, out in (("--to-hf", tmp_path / "out"), ("--to-gguf", tmp_path / "out.gguf")):
        code, _, err = cli("convert", str(tmp_path / "hf"), flag, str(out))
        assert code == 2 and "model.rope_dims=6 (a partial rotation)" in err and err.count("\n") == 1, err
        assert not out.exists()


def test_phi3_longrope_switches_sets_as_transformers_does(tmp_path):
    """Within the original context the short divisors, past it the long ones (per forward, as transformers
    decides), cos and sin times sqrt(1 + ln 4 / ln 16); the reference engine's logits too."""
    torch.manual_seed(0)
    model = perturbed(phi3_longrope())
    save_hf(model, tmp_path / "hf")
    run = qkv.load(tmp_path / "hf")
    assert run.config.model.rope_scaling == "longrope" and run.config.model.rope_original_context == 16
    for length in (10, 30):  # short set, then long
        ids = torch.randint(0, V, (1, length))
        with torch.no_grad():
            expected = model(ids).logits
            assert (run.model(ids) - expected).abs().max() < 1e-4 * expected.abs().max(), length
