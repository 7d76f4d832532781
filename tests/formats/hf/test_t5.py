"""qkv.formats.hf.t5: T5ForConditionalGeneration in and out (bucketed relative biases shared by the layers, RMSNorm
without bias, folded scales, ReLU or gated GELU, tied or not, other bucket counts and distances), logits equal
to transformers' on padded sources and targets."""
import pytest

transformers = pytest.importorskip("transformers")

from tests.formats.hf import V, check_seq2seq  # noqa: E402


def t5_config(**kw):
    """Dh = 16, D = 64: T5's folded constants sqrt(Dh) and D^-1/2 (qkv.formats.hf.t5) are exact in fp32. The init
    scale 0.2 keeps logits O(1) (T5's default gives |logits| ~ 20 here, where fp32 rounding alone is ~1e-5)."""
    return transformers.T5Config(vocab_size=V, d_model=64, d_kv=16, d_ff=64, num_layers=2, num_heads=4,
                                 decoder_start_token_id=0, initializer_factor=0.2, **kw)


MODELS = {
    "t5-relu-tied": lambda: transformers.T5ForConditionalGeneration(t5_config()),
    "t5-gated-gelu-untied": lambda: transformers.T5ForConditionalGeneration(t5_config(
        feed_forward_proj="gated-gelu", tie_word_embeddings=False, num_decoder_layers=3,
        relative_attention_max_distance=20)),
    "t5-16-buckets": lambda: transformers.T5ForConditionalGeneration(t5_config(
        relative_attention_num_buckets=16, relative_attention_max_distance=40)),
}


@pytest.mark.parametrize("name", MODELS)
def test_logits_match_transformers(name, tmp_path):
    check_seq2seq(MODELS[name](), tmp_path)
