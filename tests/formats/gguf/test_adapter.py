"""LoRA adapters as GGUF files (qkv.formats.gguf.adapter), llama.cpp the oracle: an adapter qkv writes, applied by
llama.cpp over the base GGUF at run time, gives the logits of qkv's model with the adapter (and of peft's, for
adapters peft made); an adapter written by llama.cpp's own converter from qkv's PEFT dir is read by qkv with the
same logits (and holds the same numbers as qkv's own); the bad adapters are refused in one line, exit code 2,
nothing written."""
import dataclasses
import json

import gguf
import numpy as np
import pytest
import torch

import qkv
from qkv.formats import merge_adapter
from tests.formats.gguf import llama_cpp, small_tokenizer, transformers, write_llama  # noqa: F401
from tests.formats.gguf.test_open_archs import gemma3, qwen3
from tests.formats.hf import cli, perturbed

peft = pytest.importorskip("peft", reason="peft is a test dependency (pip install -e .[dev])")

IDS = [5, 9, 30, 77, 100, 4, 8, 200, 13, 41, 66, 2, 150]


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    """A tiny llama GGUF (Q/K rows permuted, as llama.cpp's converter stores them) and a LoRA SFT run over it (lr
    high enough that every B has moved), its adapter as a GGUF file."""
    root = tmp_path_factory.mktemp("adapter")
    base = write_llama(root / "tiny.gguf", kv_heads=2)
    rows = [{"messages": [{"role": "user", "content": f"n {i}"}, {"role": "assistant", "content": "the moon"}]}
            for i in range(12)]
    (root / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    from qkv.cli import main

    assert main(["train", "--task", "sft", "--init", str(base), "--data", str(root / "rows.jsonl"), "--out",
                 str(root / "run"), "--max-steps", "6", "--lora", "r=4,alpha=8,dropout=0,targets=all-linear",
                 "--set", "train.lr=1e-2", "--set", "train.seq_len=64", "--set", "train.batch_size=4", "--set",
                 "train.precision=fp32", "--set", "train.threads=1", "--quiet", "--no-sample"]) == 0
    assert cli("convert", str(root / "run"), "--to-gguf", str(root / "adapter.gguf"))[0] == 0
    return base, root / "run", root / "adapter.gguf"


def qkv_logits(model, ids=IDS) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([ids]))[0].double().numpy()


def test_a_lora_runs_gguf_adapter_applied_by_llama_cpp_gives_qkvs_logits(lora_run):
    base, run, adapter = lora_run
    ours, plain = qkv_logits(qkv.load(run).model), qkv_logits(qkv.load(base).model)
    assert np.abs(ours - plain).max() > 0.05  # the adapter changes the function
    assert np.abs(llama_cpp.logits(base, IDS, lora=adapter) - ours).max() < 1e-4
    assert llama_cpp.greedy(base, IDS, 12, lora=adapter) == greedy(qkv.load(run), IDS, 12)


def greedy(run, ids: list[int], tokens: int) -> list[int]:
    from qkv.generate import generate

    return generate(run.model, torch.tensor([ids]), max_new_tokens=tokens, strategy="greedy")[0, len(ids):].tolist()


def test_qkv_reads_its_gguf_adapter_and_llama_cpps_converter_writes_the_same_file(lora_run, tmp_path, capsys):
    """llama.cpp's convert_lora_to_gguf.py on the run's PEFT dir (the base's config from qkv's HF export): the same
    tensors as qkv wrote, bit for bit, and read by qkv (--adapter FILE.gguf) with the run's logits."""
    base, run, adapter = lora_run
    assert cli("convert", str(base), "--to-hf", str(tmp_path / "hf"))[0] == 0
    theirs = llama_cpp.convert_lora(run, tmp_path / "hf", tmp_path / "theirs.gguf")
    mine, other = gguf.GGUFReader(adapter), gguf.GGUFReader(theirs)
    assert {t.name for t in mine.tensors} == {t.name for t in other.tensors}
    stored = {t.name: np.array(t.data) for t in other.tensors}
    assert all(np.array_equal(np.array(t.data), stored[t.name]) for t in mine.tensors)
    expected = qkv_logits(qkv.load(run).model)
    for path in (adapter, theirs):
        merged = qkv.load(base)
        assert "merged into 14 layers (r=4, scaling=2)" in merge_adapter(merged, str(path))
        np.testing.assert_allclose(qkv_logits(merged.model), expected, rtol=0, atol=1e-5)
    rc, out, err = cli("generate", str(base), "--adapter", str(theirs), "--prompt", "the", "--max-new-tokens", "4",
                       "--strategy", "greedy")
    rc_run, out_run, _ = cli("generate", str(run), "--prompt", "the", "--max-new-tokens", "4", "--strategy", "greedy")
    assert rc == rc_run == 0 and out == out_run, err


def base_and_peft(arch: str, tmp_path, rslora: bool = False):
    """A random HF model of `arch`, written as a GGUF base by qkv, and a peft LoRA over it with random A and B."""
    from qkv.data.tokenizer import Tokenizer
    from qkv.formats.gguf import save

    if arch == "llama":
        torch.manual_seed(0)
        model = perturbed(transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=len(small_tokenizer()[0]), hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-5)))
    else:
        model = {"qwen3": qwen3, "gemma3": lambda: gemma3(layers=3)}[arch]()[0]
    model.save_pretrained(tmp_path / "hf")
    run = dataclasses.replace(qkv.load(tmp_path / "hf"), tokenizer=Tokenizer.train(["To be, or not to be"] * 5, 300))
    base = save(run, tmp_path / f"{arch}.gguf")
    torch.manual_seed(1)
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "down_proj"],
                             lora_dropout=0.0, use_rslora=rslora, init_lora_weights=False, task_type="CAUSAL_LM")
    adapted = peft.get_peft_model(model, config).eval()
    adapted.save_pretrained(tmp_path / "peft")
    return base, adapted, tmp_path / "peft"


@pytest.mark.parametrize("arch,rslora", [("llama", True), ("qwen3", False), ("gemma3", False)])
def test_peft_adapters_converted_by_qkv_give_peft_logits_in_llama_cpp(arch, rslora, tmp_path, capsys):
    """peft's LoRA (rsLoRA on llama: s = alpha / sqrt(r), written as alpha' = s r), converted by `qkv convert BASE
    --adapter PEFT_DIR --to-gguf`, applied by llama.cpp over qkv's GGUF of the base: peft's logits, and llama.cpp's
    own of the merged model (`--merge-lora --to-gguf`)."""
    base, adapted, peft_dir = base_and_peft(arch, tmp_path, rslora)
    rc, _, err = cli("convert", str(base), "--adapter", str(peft_dir), "--to-gguf", str(tmp_path / "a.gguf"))
    assert rc == 0, err
    rc, _, err = cli("convert", str(base), "--adapter", str(peft_dir), "--merge-lora", "--to-gguf",
                     str(tmp_path / "merged.gguf"))
    assert rc == 0, err
    with torch.no_grad():
        expected = adapted(torch.tensor([IDS])).logits[0].double().numpy()
        with adapted.disable_adapter():
            plain = adapted(torch.tensor([IDS])).logits[0].double().numpy()
    assert np.abs(expected - plain).max() > 0.05
    theirs = llama_cpp.logits(base, IDS, lora=tmp_path / "a.gguf")
    merged = llama_cpp.logits(tmp_path / "merged.gguf", IDS)
    # Gemma: llama.cpp's GELU is a tanh approximation read from an fp16 table, so an input that rounds the other
    # way moves its output by up to 1e-3 (its AVX2 build: 6e-5 of the largest logit between adapter and merged)
    gelu = arch == "gemma3"
    assert np.abs(theirs - merged).max() < (1e-3 if gelu else 1e-5) * np.abs(merged).max()
    assert np.abs(theirs - expected).max() < (2e-3 * np.abs(expected).max() if gelu else 1e-4)


def write_adapter(path, *, arch="llama", alpha=8.0, rank=4, extra=(), drop=(), width=64):
    """A GGUF adapter written here with the gguf package: a pair on blk.0's q and v projections."""
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_type(gguf.GGUFType.ADAPTER)
    writer.add_string(gguf.Keys.Adapter.TYPE, "lora")
    if alpha is not None:
        writer.add_float32(gguf.Keys.Adapter.LORA_ALPHA, alpha)
    tensors = {f"blk.0.{p}.weight.lora_{ab}": np.full((rank, width) if ab == "a" else (out, rank), 0.01, np.float32)
               for p, out in (("attn_q", 64), ("attn_v", 32)) for ab in "ab"}
    tensors.update({name: np.ones(64, np.float32) for name in extra})
    for name, value in tensors.items():
        if name not in drop:
            writer.add_tensor(name, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


BAD = {  # an adapter that does not fit, and what the one line says
    "another base": (dict(width=48), "maps 48 -> 64 features, this model's 64 -> 64 (an adapter for another base?)"),
    "rank 0": (dict(rank=0), "blk.0.attn_q.weight.lora_a has shape [64, 0]: an empty dimension (a LoRA rank of 0)"),
    "no alpha": (dict(alpha=None), "has no adapter.lora.alpha"),
    "negative alpha": (dict(alpha=-1.0), "adapter.lora.alpha=-1.0 must be a number >= 0"),
    "another architecture": (dict(arch="qwen2"), "an adapter for a 'qwen2' model; this model is 'llama'"),
    "a norm": (dict(extra=("blk.0.attn_norm.weight",)), "'blk.0.attn_norm.weight', which is no LoRA tensor"),
    "half a pair": (dict(drop=("blk.0.attn_v.weight.lora_b",)), "blk.0.attn_v.weight has .lora_a without"),
}


@pytest.mark.parametrize("case", BAD)
def test_an_adapter_that_does_not_fit_exits_2_in_one_line_and_writes_nothing(case, lora_run, tmp_path, capsys):
    base, _, _ = lora_run
    options, message = BAD[case]
    bad = write_adapter(tmp_path / "bad.gguf", **options)
    for argv in (("generate", str(base), "--adapter", str(bad), "--prompt", "x"),
                 ("convert", str(base), "--adapter", str(bad), "--to-gguf", str(tmp_path / "out.gguf")),
                 ("convert", str(base), "--adapter", str(bad), "--merge-lora", "--out", str(tmp_path / "run"))):
        rc, out, err = cli(*argv)
        assert rc == 2 and err.startswith("qkv: error: ") and err.count("\n") == 1 and message in err, err
    assert not (tmp_path / "out.gguf").exists() and not (tmp_path / "run").exists()


def test_the_adapter_options_that_do_not_apply_are_refused(lora_run, tmp_path, capsys):
    base, run, adapter = lora_run
    cases = {("generate", str(adapter), "--prompt", "x"): "a LoRA adapter (general.type = adapter), not a model",
             ("convert", str(run), "--to-gguf", str(tmp_path / "q.gguf"), "--dtype", "q4_0"): "--dtype q4_0 for an adapter",
             ("convert", str(run), "--adapter", str(adapter), "--to-gguf", str(tmp_path / "q.gguf")): "holds its own",
             ("convert", str(base), "--merge-lora", "--to-gguf", str(tmp_path / "q.gguf")): "has no LoRA adapters",
             ("convert", str(base), "--adapter", str(tmp_path), "--to-gguf", str(tmp_path / "q.gguf")):
                 "not a PEFT adapter (no adapter_config.json)"}
    for argv, message in cases.items():
        rc, _, err = cli(*argv)
        assert rc == 2 and err.count("\n") == 1 and message in err, (argv, err)
    assert not (tmp_path / "q.gguf").exists()


def test_f16_adapters_round_trip_and_merge_lora_still_writes_the_whole_model(lora_run, tmp_path, capsys):
    from qkv.formats import read_adapter

    base, run, adapter = lora_run
    assert cli("convert", str(run), "--to-gguf", str(tmp_path / "h.gguf"), "--dtype", "f16")[0] == 0
    cfg = qkv.load(base).config.model
    full, half = read_adapter(adapter, cfg), read_adapter(tmp_path / "h.gguf", cfg)
    for name, pair in full.layers.items():
        assert torch.equal(half.layers[name].A, pair.A.half().float()) and half.layers[name].scaling == pair.scaling
        assert torch.equal(half.layers[name].B, pair.B.half().float())
    assert cli("convert", str(run), "--merge-lora", "--to-gguf", str(tmp_path / "m.gguf"))[0] == 0
    np.testing.assert_allclose(qkv_logits(qkv.load(tmp_path / "m.gguf").model), qkv_logits(qkv.load(run).model),
                               rtol=0, atol=1e-5)


def test_smollm2_with_a_lora_sft_adapter_in_llama_cpp_and_in_qkv(tmp_path, capsys):
    """The real case: a LoRA SFT run over SmolLM2 (the speller demo's rows and prompts, a few steps), its adapter
    written as GGUF and applied by llama.cpp over SmolLM2 in F32 (the Q4_1 file's weights, written by qkv): the
    run's logits within 1e-4 and its greedy tokens on the demo's prompts."""
    from qkv.generate import generate
    from tests.formats.gguf.smollm2 import require_smollm2

    smollm2 = require_smollm2()
    llama_cpp.require_llama_cpp()
    prompt = "Modern: {}\nFirst Folio:"
    pairs = [("Shake off their sterile curse.", " Shake off their sterrile curse"),
             ("The air breathes upon us here most sweetly.", " The ayre breathes vpon vs here most sweetly"),
             ("Take thou what course thou wilt!--", " Take thou what course thou wilt.")]
    rows = [{"prompt": prompt.format(modern), "completion": folio + "\n"} for modern, folio in pairs] * 2
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    rc, _, err = cli("train", "--task", "sft", "--init", str(smollm2), "--data", str(tmp_path / "rows.jsonl"), "--out",
                     str(tmp_path / "run"), "--max-steps", "2", "--lora", "r=8,alpha=16", "--set", "train.lr=1e-2",
                     "--set", "train.seq_len=48", "--set", "train.batch_size=3", "--set", "train.precision=fp32",
                     "--quiet", "--no-sample")
    assert rc == 0, err
    assert cli("convert", str(tmp_path / "run"), "--to-gguf", str(tmp_path / "adapter.gguf"))[0] == 0
    assert cli("convert", str(smollm2), "--to-gguf", str(tmp_path / "f32.gguf"))[0] == 0
    run = qkv.load(tmp_path / "run")
    theirs, plain = llama_cpp.session(tmp_path / "f32.gguf", tmp_path / "adapter.gguf"), llama_cpp.session(smollm2)
    for i, (modern, _) in enumerate(pairs):
        ids = run.tokenizer.encode(prompt.format(modern))
        ours = generate(run.model, torch.tensor([ids]), max_new_tokens=12, strategy="greedy")[0, len(ids):].tolist()
        assert llama_cpp.greedy(theirs, ids, 12) == ours
        assert llama_cpp.greedy(plain, ids, 12) != ours  # (the shipped file alone answers otherwise)
        if i == 0:
            expected = qkv_logits(run.model, ids)
            assert np.abs(llama_cpp.logits(theirs, ids) - expected).max() < 1e-4


def test_a_qwen2_files_adapter_which_qkv_writes_no_model_of(tmp_path, capsys):
    """Qwen2 / Qwen2.5 GGUF bases (Q/K/V biases, rows unpermuted), which qkv reads but does not write: peft's adapter
    over transformers' reading of the file, converted by qkv, gives peft's logits in llama.cpp."""
    base = write_llama(tmp_path / "qwen2.gguf", arch="qwen2", kv_heads=2)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=base.name,
                                                              dtype=torch.float32).eval()
    torch.manual_seed(2)
    config = peft.LoraConfig(r=2, lora_alpha=6, target_modules=["q_proj", "k_proj", "up_proj"], lora_dropout=0.0,
                             init_lora_weights=False)
    adapted = peft.get_peft_model(model, config).eval()
    adapted.save_pretrained(tmp_path / "peft")
    rc, _, err = cli("convert", str(base), "--adapter", str(tmp_path / "peft"), "--to-gguf", str(tmp_path / "a.gguf"))
    assert rc == 0, err
    with torch.no_grad():
        expected = adapted(torch.tensor([IDS])).logits[0].double().numpy()
    assert np.abs(llama_cpp.logits(base, IDS, lora=tmp_path / "a.gguf") - expected).max() < 1e-4
    # a LoRA run over the file: its adapter is written for the --init file's architecture (qkv's model of a Qwen2
    # is a LLaMA with biases, which llama.cpp would refuse, and whose Q/K rows it would permute)
    (tmp_path / "rows.jsonl").write_text(json.dumps({"prompt": "the moon", "completion": " and the stars"}) + "\n")
    rc, _, err = cli("train", "--task", "sft", "--init", str(base), "--data", str(tmp_path / "rows.jsonl"), "--out",
                     str(tmp_path / "run"), "--max-steps", "2", "--lora", "r=2,alpha=4,targets=q,k", "--set",
                     "train.lr=3e-2", "--set", "train.seq_len=16", "--set", "train.batch_size=2", "--set",
                     "train.precision=fp32", "--quiet",
                     "--no-sample")
    assert rc == 0, err
    assert cli("convert", str(tmp_path / "run"), "--to-gguf", str(tmp_path / "run.gguf"))[0] == 0
    ours = qkv_logits(qkv.load(tmp_path / "run").model)
    assert np.abs(ours - qkv_logits(qkv.load(base).model)).max() > 1e-3
    assert np.abs(llama_cpp.logits(base, IDS, lora=tmp_path / "run.gguf") - ours).max() < 1e-4


def test_every_inference_command_applies_a_gguf_adapter(lora_run, tmp_path, capsys):
    """--adapter FILE.gguf on eval, serve and explain gives what the LoRA run itself gives (generate: above)."""
    from qkv.serve.server import prepare

    base, run, adapter = lora_run
    (tmp_path / "text.txt").write_text("the moon and the stars, the sun and the moon " * 8)
    scores = [cli("eval", *model, "--data", str(tmp_path / "text.txt"), "--json") for model in
              ((str(base), "--adapter", str(adapter)), (str(run),))]
    assert scores[0][0] == scores[1][0] == 0
    ours, theirs = (json.loads(out.strip().splitlines()[-1]) for _, out, _ in scores)
    assert ours["loss"] == pytest.approx(theirs["loss"], abs=1e-5) and ours["loss"] != pytest.approx(
        json.loads(cli("eval", str(base), "--data", str(tmp_path / "text.txt"), "--json")[1].splitlines()[-1])["loss"])
    lines = []
    served = prepare(str(base), adapter=str(adapter), log=lines.append)
    assert any("merged into 14 layers" in line for line in lines)
    np.testing.assert_allclose(qkv_logits(served.run.model), qkv_logits(qkv.load(run).model), rtol=0, atol=1e-5)
    pages = []
    for model in ((str(base), "--adapter", str(adapter)), (str(run),)):
        out = tmp_path / f"page{len(pages)}.html"
        assert cli("explain", *model, "--text", "the moon", "--out", str(out))[0] == 0
        pages.append(out.read_text())
    assert f"LoRA adapter {adapter.name} merged" in pages[0]
    names = [f'"name":"{base.name}"', f'"name":"{run.name}"']
    strip = [page.replace(name, "").replace(f"; LoRA adapter {adapter.name} merged", "")
             for page, name in zip(pages, names)]
    assert strip[0] == strip[1]  # every number of the page the same


def test_a_gguf_adapter_becomes_a_peft_dir_peft_loads(lora_run, tmp_path, capsys):
    """`qkv convert BASE --adapter A.gguf --to-peft DIR`: peft puts DIR over transformers' reading of the base with
    the LoRA run's logits; an existing non-empty dir is refused, untouched."""
    base, run, adapter = lora_run
    rc, out, err = cli("convert", str(base), "--adapter", str(adapter), "--to-peft", str(tmp_path / "peft"))
    assert rc == 0 and "a PEFT adapter" in out, err
    model = transformers.AutoModelForCausalLM.from_pretrained(str(base.parent), gguf_file=base.name,
                                                              dtype=torch.float32).eval()
    adapted = peft.PeftModel.from_pretrained(model, str(tmp_path / "peft")).eval()
    with torch.no_grad():
        theirs = adapted(torch.tensor([IDS])).logits[0].double().numpy()
    np.testing.assert_allclose(theirs, qkv_logits(qkv.load(run).model), rtol=0, atol=1e-4)
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "keep.txt").write_text("mine")
    rc, _, err = cli("convert", str(base), "--adapter", str(adapter), "--to-peft", str(tmp_path / "busy"))
    assert rc == 2 and "not an empty directory" in err and (tmp_path / "busy" / "keep.txt").read_text() == "mine"
