"""Whole models, reference engine vs the torch engine in float64 from the same random weights: logits,
loss, every parameter gradient, and 10 AdamW steps (per-step losses and the final parameters)."""
import numpy as np
import pytest

from qkv.config import ModelConfig
from qkv.interop import compare_engines, randomize
from qkv.models import build_model
from qkv.errors import QkvError
from qkv.ref import UNSUPPORTED, loss_and_grads
from qkv.ref.model import ARCHITECTURES

TINY = dict(vocab_size=11, d_model=8, n_heads=2, n_layers=2, d_ff=12, max_seq_len=8)
VARIANTS = {  # together: every positional, norm, placement, activation, FFN and K/V head layout
    "gpt2": dict(),
    "llama": dict(norm="rmsnorm", ffn="glu", activation="silu", positional="rope", tie_embeddings=False,
                  bias=False, n_kv_heads=1),
    "post-ln-sinusoidal-relu": dict(norm_placement="post", positional="sinusoidal", activation="relu"),
    "alibi-naive-gelu_tanh": dict(positional="alibi", attention="naive", activation="gelu_tanh"),
    "nopos-leaky_relu-post-rms": dict(positional="none", activation="leaky_relu", norm="rmsnorm",
                                      norm_placement="post"),
    "relu6-geglu-gqa": dict(activation="relu6", ffn="glu", n_heads=4, n_kv_heads=2, tie_embeddings=False),
}


@pytest.mark.parametrize("padded", [False, True], ids=["dense", "left-padded"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_decoder_matches_torch_engine(variant, padded):
    report = compare_engines(ModelConfig(**{**TINY, **VARIANTS[variant]}), seed=3, padded=padded)
    assert report["grad_names_equal"]
    assert report["logits"] < 1e-12 and report["loss"] < 1e-12 and report["grads"] < 1e-12, report
    # Adam divides by sqrt(v): a gradient that is exactly 0 in theory (k_proj.bias) but 1e-17 in torch
    # moves by up to lr * 1e-17 / (1e-17 + eps) ~ 1e-11, so parameters agree to 1e-9, not 1e-15
    assert report["step_losses"] < 1e-10 and report["params_after_steps"] < 1e-9, report


def test_tied_gradient_is_the_sum_of_both_uses():
    """With W_out = W_E, d loss / d W_E = (embedding's scatter-add) + (output layer's H^T dL): the same
    numbers as an untied model whose two matrices happen to be equal, summed."""
    cfg = ModelConfig(**TINY)
    params = randomize(build_model(cfg).double(), 0)
    untied = {**params, "lm_head.weight": params["tok_emb.weight"].copy()}
    ids, targets = np.random.default_rng(0).integers(0, 11, (2, 2, 5))
    _, tied, _ = loss_and_grads(params, cfg, ids, targets)
    _, separate, _ = loss_and_grads(untied, ModelConfig(**TINY, tie_embeddings=False), ids, targets)
    assert "lm_head.weight" not in tied
    np.testing.assert_allclose(tied["tok_emb.weight"], separate["tok_emb.weight"] + separate["lm_head.weight"],
                               rtol=0, atol=1e-14)


def test_only_real_families_are_registered_and_the_rest_are_listed():
    assert ARCHITECTURES.names() == ["decoder"]
    assert any("encoder" in key for key in UNSUPPORTED)


def test_dropout_is_refused_with_a_clear_error():
    cfg = ModelConfig(**TINY, dropout=0.1)
    with pytest.raises(QkvError, match="model.dropout"):
        loss_and_grads({}, cfg, np.zeros((1, 2), dtype=int), np.zeros((1, 2), dtype=int))
