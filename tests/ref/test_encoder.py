"""qkv.ref.encoder: the encoder, its MLM and classifier heads and the encoder-decoder against the torch
engine in float64 from the same random weights: logits, loss, every gradient and 10 AdamW steps."""
import pytest

from qkv.config import ModelConfig
from qkv.formats.params import compare_engines
from tests.ref.test_model import TINY, assert_engines_agree

# (overrides, padded): together every family, head, pooling, token types, embed_norm / embed_scale, tying
FAMILIES = {
    "encoder-bare": (dict(arch="encoder"), True),
    "encoder-mlm-types-embed-norm-scale": (dict(arch="encoder", head="mlm", type_vocab_size=2, embed_norm=True,
                                                embed_scale=True), True),
    "encoder-mlm-untied-post-rms-shaw": (dict(arch="encoder", head="mlm", tie_embeddings=False, norm="rmsnorm",
                                              norm_placement="post", positional="shaw", bias=False), False),
    "encoder-classifier-first-xl": (dict(arch="encoder", head="classifier", n_classes=3, positional="xl"), False),
    "encoder-classifier-mean-sandwich": (dict(arch="encoder", head="classifier", n_classes=3, pooling="mean",
                                              norm_placement="sandwich"), True),
    "seq2seq-tied": (dict(arch="encoder-decoder"), True),
    "seq2seq-qk_norm": (dict(arch="encoder-decoder", qk_norm=True), False),
    "seq2seq-untied-t5-scale-norm-gqa": (dict(arch="encoder-decoder", tie_embeddings=False, positional="t5",
                                              embed_scale=True, embed_norm=True, n_heads=4, n_kv_heads=2,
                                              ffn="glu", activation="silu"), False),
}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_encoder_families_match_torch_engine(family):
    """Bare encoder (a CE loss on the hidden states), MLM and classifier heads, encoder-decoder."""
    overrides, padded = FAMILIES[family]
    assert_engines_agree(compare_engines(ModelConfig(**{**TINY, **overrides}), seed=3, padded=padded))
