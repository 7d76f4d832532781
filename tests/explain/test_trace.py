"""Every number on the page against torch: the page's embedded data (decoded as a reader's browser would
get it) equals the torch engine's fp32 forward and autograd's gradients of the same one-token loss, within
1e-5 of each array's scale, for the three families and the variants the page explains differently."""
from pathlib import Path

import numpy as np
import pytest

import qkv
from qkv.explain.page import RELATIVE_ERROR, build_page, read_data
from qkv.explain.trace import trace
from qkv.formats.base import Run
from tests.explain.oracle import oracle
from tests.serve.live import TEXT, tokenizer, write_run  # noqa: F401  (TEXT, tokenizer: for the other tests)

PROMPT = "the dog sat on the mat, said the cat"
TOL = 1e-5  # of each array's largest magnitude

VARIANTS = {
    "decoder-rope": dict(positional="rope"),
    "decoder-alibi-post-rms-glu-gqa": dict(positional="alibi", norm_placement="post", norm="rmsnorm", ffn="glu",
                                           activation="silu", n_kv_heads=2),
    "decoder-sandwich-learned-relu": dict(positional="learned", norm_placement="sandwich", activation="relu"),
    "decoder-shaw-local": dict(positional="shaw", attention="local", window=3),
    "decoder-moe": dict(positional="sinusoidal", moe_experts=4, moe_top_k=2),
    "decoder-softcap": dict(positional="rope", logit_softcap=0.5),  # a cap that bends these logits
    "decoder-bigram": dict(positional="rope", bigram_vocab=97),
    "encoder-mlm": dict(arch="encoder", head="mlm", positional="learned", embed_norm=True),
    "encoder-classifier": dict(arch="encoder", head="classifier", n_classes=3, positional="t5",
                               labels=("comedy", "history", "tragedy")),
    "encoder-decoder-t5": dict(arch="encoder-decoder", positional="t5", norm="rmsnorm", activation="relu",
                               bias=False),
}


def make_run(path: Path, **model) -> Run:
    """tests/serve/live.py's small random run (learned positions unless given), loaded as qkv.load does."""
    return qkv.load(write_run(path, **{"positional": "learned", **model}))


def close(page: np.ndarray, torch_value: np.ndarray, name: str, tol: float = TOL) -> None:
    assert page.shape == torch_value.shape, (name, page.shape, torch_value.shape)
    scale = max(float(np.abs(torch_value).max()), 1e-30)
    error = float(np.abs(page - torch_value).max())
    assert error <= tol * scale, f"{name}: max |page - torch| = {error:.3g}, {error / scale:.3g} of its scale"


def page_and_oracle(tmp_path, variant: str, target=None):
    run = make_run(tmp_path / variant, **VARIANTS[variant])
    explanation = trace(run, PROMPT, target)
    data = read_data(build_page([explanation]))
    meta, arrays = data["runs"][0]["meta"], data["runs"][0]["arrays"]
    inputs = ((np.array([meta["source_ids"]]), np.array([meta["ids"]])) if "source_ids" in meta
              else (np.array([meta["ids"]]),))
    position = None if meta["classifier"] else meta["position"]
    return run, explanation, meta, arrays, oracle(run.model, inputs, position, meta["target"]["id"])


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_every_shared_array_equals_torch(tmp_path, variant):
    run, explanation, meta, arrays, torch_values = page_and_oracle(tmp_path, variant)
    shared = sorted(set(arrays) & set(torch_values))
    layers = len(meta["layers"])
    # what is checked: per layer at least the streams, both gradients at the block's ends, and for a dense FFN
    # its hidden units; per attention Q, K, V, S, A and all five gradients
    needed = {f"{n}.ffn.stream_out" for n in range(layers)} | {f"{n}.ffn.d_stream_out" for n in range(layers)}
    needed |= {f"{n}.attn.{f}" for n in range(layers) for f in ("q", "k", "v", "scores", "weights", "d_q", "d_k",
                                                                "d_v", "d_scores", "d_weights", "d_heads")}
    needed |= {"output.logits", "output.d_logits", "output.hidden"}
    if not run.config.model.moe_experts:
        needed |= {f"{n}.ffn.{f}" for n in range(layers) for f in ("hidden", "d_hidden", "activation_grad")}
    else:
        needed |= {f"{n}.ffn.router_probs" for n in range(layers)}
    if run.config.model.head == "mlm":
        needed |= {"output.mlm_transform", "output.mlm_norm"}
    assert needed <= set(shared), sorted(needed - set(shared))
    assert len(shared) >= 20 * layers
    if run.config.model.positional in ("shaw", "xl"):  # a content-dependent bias adds its own share to q.grad,
        # k.grad: the page's dQ, dK are the kernel's (dS K / sqrt(d_k)), as its formula says
        shared = [name for name in shared if not name.endswith((".d_q", ".d_k"))]
    for name in shared:
        page = arrays[name]
        if name.endswith((".q", ".k", ".v", ".scores", ".weights")) or ".d_" in name and name.split(".")[-1] in (
                "d_q", "d_k", "d_v", "d_scores", "d_weights", "d_heads"):
            page = page.reshape(torch_values[name].shape)
        close(page, torch_values[name], name)
    close(np.array(meta["loss"]), torch_values["loss"], "loss")
    for n, layer in enumerate(meta["layers"]):  # ||dL/dtheta_l|| per layer: the gradient-flow view
        close(np.array(layer["grad_norm"]), torch_values[f"{n}.grad_norm"], f"{n}.grad_norm")


def test_bigram_rows_are_the_torch_tables_rows_and_h0_their_sum(tmp_path):
    from qkv.nn.embedding import bigram_rows, previous_tokens
    import torch

    run, explanation, meta, arrays, torch_values = page_and_oracle(tmp_path, "decoder-bigram")
    params = dict(run.model.named_parameters())
    ids = torch.tensor([meta["ids"]])
    rows = bigram_rows(previous_tokens(ids), ids, 97)[0].numpy()
    assert rows[0] == 96 and len(set(rows.tolist())) > 5  # the none row first, then hashed pairs
    bigrams = params["bigram_emb.weight"].detach().double().numpy()[rows]
    close(arrays["decoder.embed.bigrams"], bigrams, "bigrams")
    tokens = params["tok_emb.weight"].detach().double().numpy()[meta["ids"]]
    close(arrays["decoder.embed.h0"], tokens + bigrams, "h0 = E[x] + E_2[h]")  # rotary: no table rows


@pytest.mark.parametrize("variant", ["decoder-rope", "encoder-decoder-t5"])
def test_embedding_rows_and_scatter_add_equal_torch(tmp_path, variant):
    run, explanation, meta, arrays, torch_values = page_and_oracle(tmp_path, variant)
    stack = "decoder"
    weight = dict(run.model.named_parameters())["tok_emb.weight"]
    ids = meta["ids"]
    close(arrays[f"{stack}.embed.rows"], weight.detach().double().numpy()[ids], "rows")
    close(arrays[f"{stack}.embed.d_rows"], weight.grad.double().numpy()[ids], "d_rows")
    close(arrays[f"{stack}.embed.d_h0"], torch_values["0.attn.d_stream_in"] if variant == "decoder-rope" else
          torch_values[f"{len(meta['layers']) // 2}.attn.d_stream_in"], "d_h0")


def test_page_keeps_the_engine_values_to_the_stated_rounding(tmp_path):
    run = make_run(tmp_path / "r", **VARIANTS["decoder-rope"])
    explanation = trace(run, PROMPT)
    arrays = read_data(build_page([explanation]))["runs"][0]["arrays"]
    for name, page in arrays.items():  # float64 -> float32, rounded to 18 bits
        exact = explanation.arrays[name]
        assert np.all(np.abs(page - exact) <= (RELATIVE_ERROR + 2.0 ** -24) * np.abs(exact) + 1e-37), name  # + float32


def test_target_is_the_given_token_and_the_loss_its_negative_log_probability(tmp_path):
    run = make_run(tmp_path / "r", **VARIANTS["decoder-rope"])
    explanation = trace(run, PROMPT, target=" mat")
    meta, arrays = explanation.meta, explanation.arrays
    assert meta["target"]["id"] == run.tokenizer.encode(" mat")[0] and not meta["target"]["chosen"]
    logits = arrays["output.logits"]
    logp = logits - logits.max() - np.log(np.exp(logits - logits.max()).sum())
    assert meta["loss"] == pytest.approx(-logp[meta["target"]["id"]], rel=1e-12)
    onehot = np.eye(len(logits))[meta["target"]["id"]]
    np.testing.assert_allclose(arrays["output.d_logits"], np.exp(logp) - onehot, atol=1e-12)  # p - onehot
    assert meta["position"] == len(meta["ids"]) - 1


def test_default_target_is_the_top_token_and_a_classifier_takes_labels(tmp_path):
    run = make_run(tmp_path / "r", **VARIANTS["decoder-rope"])
    meta = trace(run, PROMPT).meta
    assert meta["target"]["chosen"] and meta["target"]["id"] == int(np.argmax(trace(run, PROMPT).arrays["output.logits"]))
    run = make_run(tmp_path / "c", **VARIANTS["encoder-classifier"])
    meta = trace(run, PROMPT, target="history").meta
    assert meta["target"] == {**meta["target"], "id": 1, "text": "history"}


def test_a_text_longer_than_the_models_positions_is_cut_there(tmp_path):
    run = make_run(tmp_path / "r", positional="learned", max_seq_len=8)
    meta = trace(run, PROMPT * 3).meta
    assert len(meta["ids"]) == 8 and meta["cut"] and meta["ids"] == run.tokenizer.encode(PROMPT * 3)[:8]
