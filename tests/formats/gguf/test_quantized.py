"""Quantized inference from the command line: --dtype / --quant on generate, chat, eval and serve; `qkv convert
--quant` saves the codes and scales, and the saved run loads them as they are (same logits, nothing requantized);
bad combinations get one error line."""
import json

import pytest
import torch

from qkv.formats import load
from qkv.generate import weights
from qkv.nn import quant
from qkv.nn.quant import QuantLinear, head_kind
from tests.cli.test_main import cli
from tests.formats.gguf import TEXT, write_llama


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("quant")
    return write_llama(tmp / "m.gguf", qtype="Q4_1", seed=3, width=64, ffn=128), tmp


@pytest.mark.parametrize("quant", ["int8", "int4"])
def test_convert_quant_saves_codes_that_load_as_saved(capsys, model, quant):
    path, tmp = model
    out = tmp / f"run-{quant}"
    code, _, err = cli(capsys, "convert", "--from-gguf", path, "--out", out, "--quant", quant)
    assert code == 0, err
    assert json.loads((out / "quant.json").read_text()) == {"quant": quant, "group": 32, "head": head_kind()}
    saved, direct = load(out), load(path)
    weights.prepare(direct.model, quant=quant)  # the same quantization, done in memory
    ids = torch.randint(0, 300, (1, 12))
    with torch.no_grad():
        assert torch.equal(saved.model(ids), direct.model(ids))
    kinds = {m.kind for m in saved.model.modules() if isinstance(m, QuantLinear)}
    assert kinds | {head_kind()} == ({"int4", head_kind()} if quant == "int4" else {"int8", head_kind()})
    # the file is smaller than the fp32 run's
    full = tmp / "run-fp32"
    if not full.exists():
        assert cli(capsys, "convert", "--from-gguf", path, "--out", full)[0] == 0
    assert (out / "model.safetensors").stat().st_size < 0.7 * (full / "model.safetensors").stat().st_size
    # a saved quantized run keeps its quant; another one would requantize: refused, as is exporting it
    code, _, err = cli(capsys, "generate", out, "--prompt", "To be", "--max-new-tokens", "3",
                       "--quant", "int8" if quant == "int4" else "int4")
    assert code == 2 and "requantize" in err and "Traceback" not in err
    code, _, err = cli(capsys, "convert", out, "--to-gguf", tmp / "x.gguf")
    assert code == 2 and "export the model it was converted from" in err and not (tmp / "x.gguf").exists()


def test_generate_and_eval_take_dtype_and_quant(capsys, model, tmp_path):
    path, _ = model
    text = tmp_path / "held.txt"
    text.write_text("\n".join(TEXT[:8]))
    figures = {}
    for dtype, quant in (("fp32", "none"), ("bf16", "none"), ("fp32", "int8"), ("bf16", "int4")):
        code, out, err = cli(capsys, "eval", path, "--data", text, "--json", "--dtype", dtype, "--quant", quant)
        assert code == 0, err
        result = json.loads(out)
        figures[(dtype, quant)] = result["bits_per_char"]
        assert (dtype, quant) == ("fp32", "none") or "qkv: running at" in err
        code, out, err = cli(capsys, "generate", path, "--prompt", "To be", "--strategy", "greedy",
                             "--max-new-tokens", "5", "--dtype", dtype, "--quant", quant)
        assert code == 0 and out.startswith("To be"), err
    reference = figures[("fp32", "none")]
    for key, value in figures.items():  # a random model: each precision within 1% of fp32's score
        assert abs(value - reference) < 0.01 * reference, key


def test_bad_precision_options_get_one_line(capsys, model, tmp_path):
    path, tmp = model
    code, _, err = cli(capsys, "generate", path, "--quant", "int3")
    assert code == 2 and err.count("\n") == 1 and "qkv: error:" in err
    code, _, err = cli(capsys, "convert", path, "--to-gguf", tmp_path / "y.gguf", "--quant", "int8")
    assert code == 2 and "--quant applies to --from-hf / --from-gguf" in err


def test_a_damaged_quant_file_is_refused(capsys, model, tmp_path):
    path, _ = model
    out = tmp_path / "run"
    assert cli(capsys, "convert", "--from-gguf", path, "--out", out, "--quant", "int4")[0] == 0
    (out / "quant.json").write_text(json.dumps({"quant": "int5", "group": 32}))
    code, _, err = cli(capsys, "generate", out, "--prompt", "x", "--max-new-tokens", "2")
    assert code == 2 and "quant.json" in err and "Traceback" not in err
    (out / "quant.json").write_text(json.dumps({"quant": "int8", "group": 32, "head": head_kind()}))  # other codes
    code, _, err = cli(capsys, "generate", out, "--prompt", "x", "--max-new-tokens", "2")
    assert code == 2 and "quant.json needs" in err


def test_explain_at_a_precision_computes_with_the_quantized_weights(capsys, model, tmp_path, monkeypatch):
    from qkv import hardware
    from qkv.explain.trace import trace

    path, _ = model
    monkeypatch.setattr(hardware, "native_bf16_cpu", lambda: None)  # an int8 head
    monkeypatch.setattr(quant, "quant_rows", lambda: None)  # and fp32 products: to 1e-4
    run = load(path)
    weights.round_weights(run.model, quant="int4")
    explanation = trace(run, "To be, or not to be", None)
    meta = explanation.meta
    served = load(path)
    weights.prepare(served.model, quant="int4")  # the kernels' model: the same weights
    with torch.no_grad():
        logits = served.model(torch.tensor([meta["ids"]]))[0, meta["position"]].double()
    loss = float(-logits.log_softmax(-1)[meta["target"]["id"]])
    assert abs(loss - meta["loss"]) < 1e-4
    code, out, err = cli(capsys, "explain", path, "--text", "To be", "--quant", "int4", "--dtype", "bf16",
                         "--out", tmp_path / "p.html")
    assert code == 0, err
    assert "int4 weights (the head int8), rounded to bf16, dequantized" in (tmp_path / "p.html").read_text()


def test_a_saved_quantized_run_keeps_its_scales_fp32_under_dtype_bf16(capsys, model):
    path, tmp = model
    out = tmp / "run-int4-bf16"
    assert cli(capsys, "convert", "--from-gguf", path, "--out", out, "--quant", "int4")[0] == 0
    fp32, bf16 = load(out), load(out)
    weights.prepare(fp32.model)
    description = weights.prepare(bf16.model, dtype="bf16")
    assert "int4 weights (as saved" in description and "bf16 activations" in description
    layers = [m for m in bf16.model.modules() if isinstance(m, QuantLinear)]
    assert layers and all(m.scale.dtype == torch.float32 and (m.low is None or m.low.dtype == torch.float32)
                          for m in layers)  # model.to(bf16) would have rounded them
    assert bf16.model.tok_emb.weight.dtype == torch.bfloat16
    ids = torch.randint(0, 300, (1, 10))
    with torch.no_grad():
        p, q = fp32.model(ids).float().log_softmax(-1), bf16.model(ids).float().log_softmax(-1)
    assert float((p.exp() * (p - q)).sum(-1).mean()) < 2e-3


@pytest.mark.parametrize("arch, dtype, quant", [("llama", "fp32", "int8"), ("llama", "fp32", "int4"),
                                                ("llama", "bf16", "int4"), ("llama", "bf16", "none"),
                                                ("qwen2", "fp32", "int4"), ("tied", "fp32", "int4")])
def test_a_gguf_read_a_block_at_a_time_is_the_model_read_whole(model, tmp_path, arch, dtype, quant):
    """load(convert=weights.convert_block(...)) converts each block as soon as it is read (called once a block,
    with its weights in fp32); prepare then gives the model that reading everything in fp32 and preparing it
    gives: the same description, bitwise equal logits."""
    from qkv.formats.gguf import load as load_gguf
    from tests.formats.gguf import write_llama as write

    if arch == "llama":
        path = model[0]
    else:  # a Qwen2 (Q/K/V biases the mapping adds where absent), a LLaMA whose head is its embedding
        path = write(tmp_path / "m.gguf", qtype="Q4_1", seed=4, width=64, ffn=128, arch="qwen2" if arch == "qwen2"
                     else "llama", tied=arch == "tied")
    whole = load(path)
    described = weights.prepare(whole.model, dtype=dtype, quant=quant)
    convert, seen = weights.convert_block(dtype, quant), []

    def watch(block):  # called with a block just read: all its weights real fp32, none converted yet
        seen.append(all(p.dtype == torch.float32 and not p.is_meta for p in block.parameters()))
        convert(block)
    streamed = load_gguf(path, convert=watch)
    assert seen == [True, True]
    assert weights.prepare(streamed.model, dtype=dtype, quant=quant) == described
    ids = torch.randint(0, 300, (2, 12))
    via_cli = weights.load(path, dtype=dtype, quant=quant)  # what chat, generate, eval, probe and serve call
    assert weights.prepare(via_cli.model, dtype=dtype, quant=quant) == described
    with torch.no_grad():
        assert torch.equal(streamed.model(ids), whole.model(ids))
        assert torch.equal(via_cli.model(ids), whole.model(ids))
    # nothing to convert, or a model bound for another device (where --quant is refused): read whole
    assert weights.convert_block("fp32", "none") is None and weights.convert_block(dtype, quant, "cuda") is None


def test_a_gpt2_gguf_is_read_whole_and_converted_after(tmp_path):
    """gpt2's mapping makes Q, K and V from one tensor: the file is read at once, convert is not called, and
    prepare converts the loaded model as it would any."""
    from tests.formats.gguf import write_gpt2

    path = write_gpt2(tmp_path / "g.gguf", seed=2)
    calls = []
    streamed, whole = load(path, convert=calls.append), load(path)
    assert calls == []
    assert weights.prepare(streamed.model, quant="int8") == weights.prepare(whole.model, quant="int8")
    ids = torch.randint(0, 100, (1, 9))
    with torch.no_grad():
        assert torch.equal(streamed.model(ids), whole.model(ids))
