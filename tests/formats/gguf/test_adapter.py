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
    from qkv.cli.options import merge_adapter

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
    assert np.abs(theirs - merged).max() < 1e-5 * np.abs(merged).max()
    # Gemma: llama.cpp's GELU is a tanh approximation read from an fp16 table, 1e-3 of these logits away
    assert np.abs(theirs - expected).max() < (1e-4 if arch != "gemma3" else 2e-3 * np.abs(expected).max())
