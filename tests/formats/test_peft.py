"""LoRA adapters in PEFT's format (qkv.formats.peft): peft itself is the oracle both ways."""
import json

import pytest
import torch

import qkv
from qkv.formats import merge_adapter
from qkv.formats import peft as qkv_peft
from tests.cli.test_main import cli
from tests.formats.gguf import write_llama

peft = pytest.importorskip("peft", reason="peft is a test dependency (pip install -e .[dev])")
transformers = pytest.importorskip("transformers")


def hf_model(path):
    return transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                             dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    """A tiny llama GGUF, and a LoRA SFT run of it (lr high enough that every B has moved)."""
    root = tmp_path_factory.mktemp("peft")
    gguf_file = write_llama(root / "tiny.gguf", kv_heads=2)
    rows = [{"messages": [{"role": "user", "content": f"n {i}"}, {"role": "assistant", "content": "the moon"}]}
            for i in range(12)]
    data = root / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    from qkv.cli import main

    rc = main(["train", "--task", "sft", "--init", str(gguf_file), "--data", str(data), "--out", str(root / "run"),
               "--max-steps", "6", "--lora", "r=4,alpha=8,dropout=0,targets=all-linear", "--set", "train.lr=1e-2",
               "--set", "train.seq_len=64", "--set", "train.batch_size=4", "--set", "train.precision=fp32",
               "--set", "train.threads=1", "--quiet", "--no-sample"])
    assert rc == 0
    return gguf_file, root / "run"


IDS = torch.randint(0, 300, (2, 17), generator=torch.Generator().manual_seed(0))


def test_peft_loads_qkvs_adapter_with_equal_logits(lora_run):
    gguf_file, run = lora_run
    ours = qkv.load(run).model  # the run's adapters, merged at load
    theirs = peft.PeftModel.from_pretrained(hf_model(gguf_file), str(run)).eval()
    with torch.no_grad():
        expected = theirs(IDS).logits
        torch.testing.assert_close(ours(IDS), expected, rtol=1e-4, atol=1e-4)
        with theirs.disable_adapter():
            assert (theirs(IDS).logits - expected).abs().max() > 1e-3  # the adapters changed the function


@pytest.mark.parametrize("rslora", [False, True])
def test_qkv_loads_an_adapter_made_by_peft(tmp_path, rslora):
    gguf_file = write_llama(tmp_path / "tiny.gguf", kv_heads=2, seed=3)
    config = peft.LoraConfig(r=4, lora_alpha=12, target_modules=["q_proj", "v_proj", "down_proj"], lora_dropout=0.0,
                             use_rslora=rslora, task_type="CAUSAL_LM")
    model = peft.get_peft_model(hf_model(gguf_file), config)
    torch.manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.2)
    model.save_pretrained(str(tmp_path / "adapter"))
    run = qkv.load(gguf_file)
    spec = qkv_peft.read_spec(tmp_path / "adapter")
    assert "merged into" in merge_adapter(run, tmp_path / "adapter")
    assert spec.rslora == rslora and sorted(spec.targets) == ["down", "q", "v"]
    with torch.no_grad():
        torch.testing.assert_close(run.model(IDS), model.eval()(IDS).logits, rtol=1e-4, atol=1e-4)


def test_merge_lora_then_export_keeps_the_logits(lora_run, tmp_path, capsys):
    gguf_file, run = lora_run
    expected = qkv.load(run).model(IDS).detach()
    rc, _, err = cli(capsys, "convert", str(run), "--merge-lora", "--out", str(tmp_path / "merged"))
    assert rc == 0, err
    merged = qkv.load(tmp_path / "merged")
    assert merged.config.train.lora == "" and merged.chat == qkv.load(gguf_file).chat
    torch.testing.assert_close(merged.model(IDS).detach(), expected, rtol=1e-5, atol=1e-5)
    assert cli(capsys, "convert", str(tmp_path / "merged"), "--to-hf", str(tmp_path / "hf"))[0] == 0
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf")).eval()
    torch.testing.assert_close(hf(IDS).logits.detach(), expected, rtol=1e-4, atol=1e-4)
    assert cli(capsys, "convert", str(tmp_path / "merged"), "--to-gguf", str(tmp_path / "m.gguf"))[0] == 0
    torch.testing.assert_close(qkv.load(tmp_path / "m.gguf").model(IDS).detach(), expected, rtol=1e-4, atol=1e-4)


def test_generate_with_adapter_equals_the_merged_run(lora_run, capsys):
    gguf_file, run = lora_run
    args = ["--prompt", "n 3", "--max-new-tokens", "8", "--strategy", "greedy"]
    rc, with_adapter, err = cli(capsys, "generate", str(gguf_file), "--adapter", str(run), *args)
    assert rc == 0 and "LoRA adapter" in err and "merged into 14 layers" in err, err
    assert with_adapter == cli(capsys, "generate", str(run), *args)[1]


@pytest.mark.parametrize("edit, message", [
    ({"use_dora": True}, "use_dora=true is not supported"),
    ({"peft_type": "IA3"}, "peft_type must be \"LORA\""),
    ({"target_modules": ["c_attn"]}, "target_modules="),
    ({"modules_to_save": ["lm_head"]}, "modules_to_save="),
])
def test_adapter_options_qkv_does_not_implement_are_refused(lora_run, tmp_path, capsys, edit, message):
    gguf_file, run = lora_run
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    config = json.loads((run / "adapter_config.json").read_text())
    (adapter / "adapter_config.json").write_text(json.dumps({**config, **edit}))
    (adapter / "adapter_model.safetensors").write_bytes((run / "adapter_model.safetensors").read_bytes())
    rc, _, err = cli(capsys, "generate", str(gguf_file), "--adapter", str(adapter), "--prompt", "x")
    assert rc == 2 and message in err and "Traceback" not in err, err


def test_lora_needs_an_init_and_the_torch_engine(tmp_path, capsys):
    rc, _, err = cli(capsys, "train", "--preset", "tiny", "--lora", "r=4", "--out", str(tmp_path / "a"),
                     "--max-steps", "1")
    assert rc == 2 and "give --init" in err, err
    rc, _, err = cli(capsys, "train", "--preset", "tiny", "--lora", "r=4", "--engine", "ref", "--out",
                     str(tmp_path / "b"), "--max-steps", "1")
    assert rc == 2 and "--engine ref" in err, err
    rc, _, err = cli(capsys, "train", "--preset", "tiny", "--lora", "r=4,targets=lm_head", "--out",
                     str(tmp_path / "c"), "--max-steps", "1")
    assert rc == 2 and "target 'lm_head'" in err, err


@pytest.mark.parametrize("base", ["int8", "int4"])
def test_qlora_trains_over_a_quantized_base_and_resumes(lora_run, tmp_path, capsys, base):
    """The run's model is the init's blocks quantized (round trip through the codes) plus the trained adapters."""
    from qkv.nn.quant import QuantLinear

    gguf_file, _ = lora_run
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"n {i}", "completion": " the moon"}) + "\n" for i in range(12)))
    out = tmp_path / "run"
    common = ["--set", "train.seq_len=64", "--set", "train.batch_size=4", "--set", "train.precision=fp32",
              "--set", "train.threads=1", "--set", "train.lr=1e-2", "--quiet", "--no-sample"]
    rc, _, err = cli(capsys, "train", "--task", "sft", "--init", str(gguf_file), "--data", str(data), "--out", str(out),
                     "--max-steps", "4", "--lora", f"r=4,alpha=8,dropout=0,base={base}", "--set",
                     "train.checkpoint_every=2", *common)
    assert rc == 0 and f"base={base}" in err, err
    expected = qkv.load(gguf_file)
    with torch.no_grad():
        for module_name, module in list(expected.model.named_modules()):
            for child_name, child in list(module.named_children()):
                if isinstance(child, torch.nn.Linear) and module_name.startswith("blocks."):
                    child.weight.copy_(QuantLinear.from_linear(child, base).weight)  # the frozen base it trained on
    merge_adapter(expected, out)
    torch.testing.assert_close(qkv.load(out).model(IDS).detach(), expected.model(IDS).detach(), rtol=1e-4, atol=1e-4)
    rc, _, err = cli(capsys, "train", "--out", str(out), "--resume", "--max-steps", "5", "--quiet", "--no-sample")
    assert rc == 0 and "resuming from the checkpoint at step 4" in err, err


def sft_matches_peft(capsys, gguf_file, tmp_path) -> None:
    """The GGUF file out as an HF dir, LoRA SFT from it over the attention (4 steps), and peft's own reading of the
    run's adapter over transformers' model of that dir: qkv's logits, and changed from the base's."""
    hf = tmp_path / "exported"
    assert cli(capsys, "convert", str(gguf_file), "--to-hf", str(hf))[0] == 0
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"n {i}", "completion": " the moon"}) + "\n" for i in range(8)))
    rc, _, err = cli(capsys, "train", "--task", "sft", "--init", str(hf), "--data", str(data), "--out",
                     str(tmp_path / "run"), "--max-steps", "4", "--lora", "r=4,alpha=8,dropout=0,targets=q,k,v,o",
                     "--set", "train.lr=1e-2", "--set", "train.seq_len=32", "--set", "train.batch_size=4", "--set",
                     "train.precision=fp32", "--quiet", "--no-sample")
    assert rc == 0, err
    base = transformers.AutoModelForCausalLM.from_pretrained(str(hf)).eval()
    with torch.no_grad():
        before = base(IDS).logits
    theirs = peft.PeftModel.from_pretrained(base, str(tmp_path / "run")).eval()  # (wraps base in place)
    with torch.no_grad():
        ours = qkv.load(tmp_path / "run").model(IDS)
        torch.testing.assert_close(ours, theirs(IDS).logits, rtol=1e-4, atol=1e-4)
        assert (ours - before).abs().max() > 1e-4  # the adapter changed something


def test_a_qwen2_hf_dir_adapted_by_qkv_loads_in_peft(tmp_path, capsys):
    """--init from a Hugging Face dir (a Qwen2: Q/K/V biases, which LoRA leaves frozen) to peft's own reading."""
    sft_matches_peft(capsys, write_llama(tmp_path / "qwen.gguf", arch="qwen2", seed=5), tmp_path)


def test_the_config_alone_is_what_loading_gives_for_every_format(lora_run, tmp_path, capsys):
    """formats.load_config reads metadata only (the init's config of `qkv train --init`): equal to load's config
    for a GGUF file, the HF dir exported from it, and a LoRA run dir (whose config says lora="", merged)."""
    from qkv.formats import load_config

    gguf_file, run = lora_run
    assert cli(capsys, "convert", str(gguf_file), "--to-hf", str(tmp_path / "hf"))[0] == 0
    for path in (gguf_file, tmp_path / "hf", run):
        assert load_config(path) == qkv.load(path).config, path
    assert qkv.load(run).config.train.lora == "" and json.loads((run / "config.json").read_text())["train"]["lora"]


def test_a_qwen3_moe_adapted_by_qkv_loads_in_peft(tmp_path, capsys):
    """An MoE base (Qwen3-MoE, a GGUF qkv writes): LoRA over its attention, as peft reads it over transformers'."""
    from tests.formats.gguf.test_moe_archs import written

    sft_matches_peft(capsys, written(tmp_path, "qwen3moe")[1], tmp_path)
