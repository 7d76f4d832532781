"""qkv.formats.hf.bart: BartForConditionalGeneration in and out (learned positions offset by 2, the embedding
LayerNorm, scaled embeddings, ReLU or GELU), logits equal to transformers' on padded sources and targets."""
import pytest

transformers = pytest.importorskip("transformers")

from tests.formats.hf import V, check_seq2seq  # noqa: E402

MODELS = {
    "bart": lambda: transformers.BartForConditionalGeneration(transformers.BartConfig(
        vocab_size=V, d_model=32, encoder_layers=2, decoder_layers=3, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=32)),
    "bart-scaled": lambda: transformers.BartForConditionalGeneration(transformers.BartConfig(
        vocab_size=V, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=32,
        scale_embedding=True, activation_function="relu")),
}


@pytest.mark.parametrize("name", MODELS)
def test_logits_match_transformers(name, tmp_path):
    check_seq2seq(MODELS[name](), tmp_path)
