"""qkv.explain.tap: the recorder is transparent (a tapped forward and backward give the reference engine's
logits and gradients bit for bit) and what it keeps obeys the formulas it is shown beside: A = softmax(S)
with S = Q K^T / sqrt(d_k) on the allowed keys, Pre-LN's x + F(LN(x)), LayerNorm's statistics, the ReLU mask,
and the residual's dL/dx = dL/dy + the sublayer path."""
import numpy as np
import pytest

from qkv import ref
from qkv.formats.params import randomize, to_numpy
from qkv.config import ModelConfig
from qkv.errors import QkvError
from qkv.explain.tap import Recorder
from qkv.models import build_model
from qkv.ref.block import tapped
from qkv.ref.functional import softmax

TINY = dict(vocab_size=13, d_model=8, n_heads=2, n_layers=2, d_ff=12, max_seq_len=8, activation="relu")


def run_both(**overrides):
    cfg = ModelConfig(**{**TINY, **overrides})
    params = randomize(build_model(cfg).double(), 0)
    ids = np.random.default_rng(0).integers(0, 13, (1, 6))
    dlogits = np.random.default_rng(1).normal(size=(1, 6, 13))
    plain_logits, cache = ref.forward(params, cfg, ids)
    plain_grads = ref.backward(dlogits, cache, cfg)
    recorder = Recorder()
    with tapped(recorder):
        logits, cache = ref.forward(params, cfg, ids)
        grads = ref.backward(dlogits, cache, cfg)
    return recorder, (plain_logits, plain_grads), (logits, grads)


def test_tapping_changes_no_number_of_the_engine():
    _, (plain_logits, plain_grads), (logits, grads) = run_both()
    np.testing.assert_array_equal(logits, plain_logits)
    assert grads.keys() == plain_grads.keys()
    for name in grads:
        np.testing.assert_array_equal(grads[name], plain_grads[name], err_msg=name)


def test_recorded_attention_is_softmax_of_the_scaled_scores_on_the_allowed_keys():
    recorder, _, _ = run_both()
    assert len(recorder.blocks) == 2
    for block in recorder.blocks:
        attn = next(p for p in block["parts"] if p["name"] == "attn")
        q, k, allowed = attn["q"], attn["k"], attn["allowed"]  # (B, H, T, Dh), (B, T, T)
        scores = q @ k.swapaxes(-1, -2) / np.sqrt(q.shape[-1])
        np.testing.assert_allclose(attn["scores"], scores, atol=1e-12)
        expected = softmax(np.where(allowed[:, None], scores, -np.inf))
        np.testing.assert_allclose(attn["weights"], expected, atol=1e-12)
        assert not allowed[0][np.triu_indices(6, 1)].any()  # causal: no query sees a later key
        np.testing.assert_allclose(attn["heads"], attn["weights"] @ attn["v"], atol=1e-12)


def test_recorded_stream_norm_and_ffn_follow_their_formulas():
    recorder, _, _ = run_both()
    for part in (p for block in recorder.blocks for p in block["parts"]):
        norm = part["norm"]
        np.testing.assert_allclose(part["stream_out"], part["stream_in"] + part["output"], atol=1e-12)  # Pre-LN
        np.testing.assert_array_equal(norm["input"], part["stream_in"])
        np.testing.assert_allclose(norm["mean"], part["stream_in"].mean(-1), atol=1e-12)
        np.testing.assert_allclose(norm["var"], part["stream_in"].var(-1), atol=1e-12)
        if part["name"] == "ffn":
            np.testing.assert_array_equal(part["activation_grad"], (part["pre_activation"] > 0).astype(float))
            np.testing.assert_allclose(part["hidden"], np.maximum(part["pre_activation"], 0), atol=1e-15)


def test_recorded_backward_is_the_residual_rule():
    recorder, _, _ = run_both()
    for part in (p for block in recorder.blocks for p in block["parts"]):
        # Pre-LN: dL/dx = dL/dy + LN'(x)^T F'(LN x)^T dL/dy, the second term being what the norm passes back
        np.testing.assert_allclose(part["d_stream_in"], part["d_stream_out"] + part["norm"]["d_input"], atol=1e-12)
        np.testing.assert_array_equal(part["d_output"], part["d_stream_out"])


def test_a_kernel_that_forms_no_attention_matrix_is_refused():
    with pytest.raises(QkvError, match="forms no A"):
        run_both(attention="linear")
