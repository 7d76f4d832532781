"""`qkv calc`: the text and --json reports, the GPT-3 reproduction, and bad input as one `qkv: error:` line."""
import json
from dataclasses import replace

import pytest

from qkv.analysis import memory, params
from qkv import presets
from tests.analysis import run_cli


def calc_json(*argv) -> dict:
    rc, out, err = run_cli("calc", *argv, "--json")
    assert rc == 0, err
    return json.loads(out)


def test_gpt3_reproduction():
    """175B parameters, 6ND = 3.14e23 for 300B tokens, 16 bytes/param in mixed precision (claim 23)."""
    r = calc_json("--preset", "gpt3-175b", "--tokens", "300e9", "--precision", "fp16", "--batch", "1")
    assert r["params"]["total"] == pytest.approx(175e9, rel=0.005)
    assert r["compute"]["six_nd"] == pytest.approx(3.14e23, rel=0.005)
    assert r["memory"]["bytes_per_param"] == 16
    states = sum(r["memory"]["bytes"][k] for k in ("weights", "gradients", "master_weights", "optimizer_states"))
    assert states == pytest.approx(16 * r["params"]["total"])
    assert r["flops"]["components"]["total"]["backward"] == 2 * r["flops"]["components"]["total"]["forward"]


def test_options_reach_the_calculators():
    base = calc_json("--preset", "tiny", "--set", "model.n_kv_heads=1")
    tiny = presets.get("tiny")  # a new run trains a tokenizer of data.vocab_size tokens: the model's vocabulary
    vocab = max(tiny.model.vocab_size, tiny.data.vocab_size)
    assert base["params"]["total"] == params.count(replace(tiny.model, n_kv_heads=1, vocab_size=vocab))
    assert base["model"]["vocab_size"] == vocab
    assert base["setup"]["batch"] == 8 and base["setup"]["seq"] == 32  # the preset's train section
    plain = calc_json("--preset", "tiny")
    sharded = calc_json("--preset", "tiny", "--zero", "3", "--gpus", "4", "--checkpointing", "--batch", "2")
    root = 4 * memory.root_params(replace(tiny.model, vocab_size=vocab), memory.Setup())  # FSDP2's root unit
    assert sharded["memory"]["bytes"]["weights"] == (plain["memory"]["bytes"]["weights"] - root) / 4 + root
    assert sharded["memory"]["bytes"]["activations"] < plain["memory"]["bytes"]["activations"]
    assert sharded["setup"]["checkpointing"] is True
    staged = calc_json("--preset", "tiny", "--pp", "2", "--tp", "2")  # the most loaded rank of the grid
    assert staged["setup"]["pp"] == staged["setup"]["tp"] == 2
    assert staged["memory"]["bytes"]["weights"] < plain["memory"]["bytes"]["weights"] / 2 * 1.5
    assert staged["setup"]["microbatches"] == 4 and staged["setup"]["batch"] == 2  # parallel.microbatches: 8 / 4
    gpipe = calc_json("--preset", "tiny", "--pp", "2", "--schedule", "gpipe", "--microbatches", "2")
    assert gpipe["setup"]["batch"] == 4 and gpipe["setup"]["schedule"] == "gpipe"
    # GPipe's last stage holds both micro-batches of 4 where 1F1B (4 of 2) holds one of 2
    assert gpipe["memory"]["bytes"]["activations"] > 2 * staged["memory"]["bytes"]["activations"]
    own = calc_json("--preset", "tiny", "--precision", "bf16")["memory"]["bytes"]  # fp32 weights under autocast
    textbook = calc_json("--preset", "tiny", "--precision", "bf16", "--layout", "textbook")["memory"]["bytes"]
    assert own["master_weights"] == 0 and own["weights"] == plain["memory"]["bytes"]["weights"]
    assert textbook["master_weights"] == 2 * textbook["weights"] == plain["memory"]["bytes"]["weights"]
    mfu = calc_json("--preset", "tiny", "--step-time", "0.5", "--peak-flops", "1e12")["mfu"]
    assert mfu["mfu"] == pytest.approx(mfu["model_flops_per_s"] / 1e12)


def test_text_report():
    rc, out, err = run_cli("calc", "--preset", "llama-small", "--tokens", "1e9")
    assert rc == 0, err
    for heading in ("parameters", "FLOPs for", "training memory per GPU", "KV cache", "6ND"):
        assert heading in out


@pytest.mark.parametrize("argv,needle", [
    (["--preset", "nope"], "choose from"),
    (["--set", "model.d_model=-1"], "model.d_model"),
    (["--set", "model.wat=1"], "unknown key"),
    (["--zero", "7"], "invalid choice"),
    (["--tokens", "lots"], "not a number"),
    (["--step-time", "1"], "--peak-flops"),
    (["--preset", "tiny", "--seq", "1000"], "max_seq_len"),
    (["--preset", "tiny", "--microbatches", "4"], "--pp > 1"),
    (["--preset", "tiny", "--schedule", "gpipe"], "--pp > 1"),
])
def test_bad_input_is_one_line(argv, needle):
    rc, out, err = run_cli("calc", *argv)
    assert rc == 2 and out == ""
    assert err.startswith("qkv: error:") and err.count("\n") == 1 and needle in err
