"""Dirs and commands: qkv -> HF -> qkv bit for bit, `qkv convert` both ways, converted runs used by
`qkv generate` and `qkv eval`, sharded checkpoints, tokenizers without <|endoftext|>, unsupported
architectures (exit 2), and loading without transformers."""
import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

import qkv
from qkv.config import ModelConfig, RunConfig
from qkv.data.tokenizer import Tokenizer
from qkv.errors import QkvError
from qkv.models import build_model
from qkv import files
from tests.formats.hf import V, cli, max_diff, right_padded, save_hf
from tests.train import verse

transformers = pytest.importorskip("transformers")

SMALL = dict(vocab_size=300, d_model=32, n_heads=4, n_layers=2, d_ff=64, max_seq_len=32)
QKV_MODELS = {  # qkv configs that have an HF family
    "gpt2": ModelConfig(**SMALL, activation="gelu_tanh"),
    "llama": ModelConfig(**SMALL, n_kv_heads=2, positional="rope", norm="rmsnorm", ffn="glu", activation="silu",
                         bias=False, tie_embeddings=False, norm_eps=1e-6),
    "bert-mlm": ModelConfig(**SMALL, arch="encoder", head="mlm", norm_placement="post", type_vocab_size=2,
                            embed_norm=True, norm_eps=1e-12),
    "bart": ModelConfig(**{**SMALL, "n_layers": 1}, arch="encoder-decoder", n_decoder_layers=2,
                        norm_placement="post", embed_norm=True),
    # Dh = 16 and D = 64: the T5 scale folds (sqrt(Dh) = 4, D^-1/2 = 1/8) are exact in floating point
    "t5": ModelConfig(**{**SMALL, "d_model": 64}, arch="encoder-decoder", positional="t5", norm="rmsnorm",
                      bias=False, activation="relu"),
}


def write_run(path, cfg: ModelConfig, tokenizer: Tokenizer | None = None):
    """A qkv run dir as training leaves it: config.json, tokenizer.json, model.safetensors."""
    model = build_model(cfg)
    for p in model.parameters():  # no zero or one-valued parameters: every tensor must be carried
        p.data.normal_(0, 0.3)
    path.mkdir(parents=True)
    RunConfig(model=cfg).save(path / "config.json")
    (tokenizer or bpe()).save(path / "tokenizer.json")
    save_file(files.model_tensors(model), str(path / files.MODEL_FILE))
    return path


_BPE = {}


def bpe() -> Tokenizer:
    if "tok" not in _BPE:
        _BPE["tok"] = Tokenizer.train([verse()], vocab_size=300)
    return _BPE["tok"]


@pytest.mark.parametrize("name", QKV_MODELS)
def test_qkv_hf_qkv_round_trip_is_bit_for_bit(name, tmp_path):
    cfg = QKV_MODELS[name]
    run_dir = write_run(tmp_path / "run", cfg)
    code, _, err = cli("convert", str(run_dir), "--to-hf", str(tmp_path / "hf"))
    assert code == 0, err
    code, _, err = cli("convert", "--from-hf", str(tmp_path / "hf"), "--out", str(tmp_path / "back"))
    assert code == 0, err
    before, after = load_file(str(run_dir / "model.safetensors")), load_file(str(tmp_path / "back/model.safetensors"))
    assert before.keys() == after.keys()
    for key in before:
        assert torch.equal(before[key], after[key]), key
    back = RunConfig.load(tmp_path / "back/config.json").model
    for field in ("arch", "d_model", "n_heads", "n_kv_heads", "positional", "norm", "norm_placement", "ffn",
                  "activation", "bias", "tie_embeddings", "head", "embed_norm", "norm_eps"):
        assert getattr(back, field) == getattr(cfg, field), field


def test_exported_gpt2_run_matches_in_transformers_and_keeps_its_tokenizer(tmp_path):
    run = qkv.load(write_run(tmp_path / "run", ModelConfig(**{**SMALL, "vocab_size": bpe().vocab_size})))
    out = qkv.formats.hf.save(run, tmp_path / "hf")
    oracle = transformers.GPT2LMHeadModel.from_pretrained(out).eval()
    ids, mask = right_padded(2, 20, [20, 11])
    with torch.no_grad():
        assert max_diff(run.model(ids, attention_mask=mask), oracle(input_ids=ids, attention_mask=mask).logits,
                        mask) <= 1e-5
    text = "Thou art more fair than morning light"
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    assert hf_tokenizer(text)["input_ids"] == run.tokenizer.encode(text)


@pytest.fixture
def converted_gpt2(tmp_path):
    """A random GPT-2 with a qkv-trained byte-level BPE tokenizer, converted to a qkv run."""
    config = transformers.GPT2Config(vocab_size=bpe().vocab_size, n_positions=64, n_embd=32, n_layer=2, n_head=4)
    hf_dir = save_hf(transformers.GPT2LMHeadModel(config), tmp_path / "hf")
    bpe().save(hf_dir / "tokenizer.json")
    code, _, err = cli("convert", "--from-hf", str(hf_dir), "--out", str(tmp_path / "run"))
    assert code == 0, err
    return tmp_path / "run"


def test_converted_run_generates_and_evaluates(converted_gpt2, tmp_path, capsys):
    from qkv.cli import main

    assert main(["generate", str(converted_gpt2), "--prompt", "Thou art", "--strategy", "greedy",
                 "--max-new-tokens", "8"]) == 0
    assert capsys.readouterr().out.startswith("Thou art")
    text = tmp_path / "eval.txt"
    text.write_text(verse(lines=6, repeats=1))
    assert main(["eval", str(converted_gpt2), "--data", str(text), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["loss"] == pytest.approx(result["loss"]) and result["loss"] > 0  # finite, positive


def test_sharded_checkpoint_loads_like_the_single_file(tmp_path):
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2))
    path = save_hf(model, tmp_path / "hf")
    tensors = load_file(str(path / "model.safetensors"))
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, str(path / file), metadata={"format": "pt"})
    (path / "model.safetensors").unlink()
    index = {"metadata": {}, "weight_map": {k: file for file, keys in shards.items() for k in keys}}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    ids = torch.randint(0, V, (1, 12))
    with torch.no_grad():
        assert max_diff(qkv.load(path).model(ids), model(input_ids=ids).logits) <= 1e-5


def test_eos_token_of_another_name_stands_in_for_endoftext(tmp_path):
    """A LLaMA-style tokenizer with </s> (id 2): qkv's Tokenizer sees it as <|endoftext|>, same id; the
    converted run keeps the original tokenizer.json and the HF export writes it back unchanged."""
    from tokenizers import Tokenizer as HFTokenizer, models, pre_tokenizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{chr(97 + i): 3 + i for i in range(26)}}
    hf_tok = HFTokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    hf_tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    hf_tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        eos_token_id=2, bos_token_id=1))
    path = save_hf(model, tmp_path / "hf")
    hf_tok.save(str(path / "tokenizer.json"))
    original = (path / "tokenizer.json").read_text()
    run = qkv.load(path)
    assert run.tokenizer.eos_id == 2 and run.tokenizer.encode("abc") == [3, 4, 5]
    assert cli("convert", "--from-hf", str(path), "--out", str(tmp_path / "run"))[0] == 0
    assert cli("convert", str(tmp_path / "run"), "--to-hf", str(tmp_path / "out"))[0] == 0
    assert (tmp_path / "out/tokenizer.json").read_text() == original
    assert transformers.AutoTokenizer.from_pretrained(tmp_path / "out").eos_token == "</s>"


def test_unsupported_architecture_exits_2_naming_it_and_the_supported_ones(tmp_path):
    path = tmp_path / "falcon"
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"model_type": "falcon", "architectures": ["FalconForCausalLM"]}))
    code, _, err = cli("convert", "--from-hf", str(path), "--out", str(tmp_path / "run"))
    assert code == 2 and err.count("\n") == 1 and err.startswith("qkv: error:")
    assert "FalconForCausalLM" in err and "GPT2LMHeadModel" in err and "T5ForConditionalGeneration" in err
    assert not (tmp_path / "run").exists()


def test_unmappable_config_and_bad_usage_exit_2(tmp_path):
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}))
    path = save_hf(model, tmp_path / "hf")
    code, _, err = cli("convert", "--from-hf", str(path), "--out", str(tmp_path / "run"))
    assert code == 2 and "rope_type='dynamic'" in err and "supported: default, linear, llama3, yarn" in err
    assert cli("convert", "--from-hf", str(path))[0] == 2  # no --out
    run = write_run(tmp_path / "alibi", ModelConfig(**SMALL, positional="alibi"))
    code, _, err = cli("convert", str(run), "--to-hf", str(tmp_path / "x"))
    assert code == 2 and "no Hugging Face family" in err and "gpt2:" in err


def test_loading_never_imports_transformers(tmp_path):
    path = save_hf(transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=V, n_positions=16, n_embd=32, n_layer=1, n_head=4)), tmp_path / "hf")
    code = ("import sys, torch, qkv; run = qkv.load(sys.argv[1]); run.model(torch.zeros(1, 3, dtype=torch.long)); "
            "qkv.formats.hf.save(run, sys.argv[2]); assert 'transformers' not in sys.modules, 'imported'")
    done = subprocess.run([sys.executable, "-c", code, str(path), str(tmp_path / "out")], capture_output=True,
                          text=True)
    assert done.returncode == 0, done.stderr


def test_train_resume_fine_tunes_the_imported_weights(converted_gpt2, tmp_path, monkeypatch, capsys):
    from qkv.cli import main

    monkeypatch.setenv("QKV_CACHE", str(tmp_path / "cache"))
    text = tmp_path / "verse.txt"
    text.write_text(verse())
    config = json.loads((converted_gpt2 / "config.json").read_text())
    config["data"]["paths"] = [str(text)]
    config["train"].update(batch_size=2, seq_len=16, eval_batches=1, log_every=1)
    (converted_gpt2 / "config.json").write_text(json.dumps(config))
    imported = load_file(str(converted_gpt2 / "model.safetensors"))
    assert main(["train", "--out", str(converted_gpt2), "--resume", "--max-steps", "1", "--quiet",
                 "--no-sample"]) == 0
    tuned = load_file(str(converted_gpt2 / "model.safetensors"))
    assert max(float((tuned[k] - imported[k]).abs().max()) for k in imported) < 0.01  # one small step away


def test_save_takes_a_bare_model_with_its_config(tmp_path):
    from qkv.errors import QkvError

    cfg = QKV_MODELS["llama"]
    model = build_model(cfg).eval()
    with pytest.raises(QkvError, match="needs config"):
        qkv.formats.hf.save(model, tmp_path / "none")
    oracle = transformers.LlamaForCausalLM.from_pretrained(qkv.formats.hf.save(model, tmp_path / "hf", config=cfg)).eval()
    ids = torch.randint(0, V, (2, 12))
    with torch.no_grad():
        assert max_diff(model(ids), oracle(input_ids=ids).logits) <= 1e-5
    with pytest.raises(QkvError, match="not empty"):  # never overwrites
        qkv.formats.hf.save(model, tmp_path / "hf", config=cfg)


NOT_EXPORTABLE = {  # a field none of the Hugging Face families has, and the start of its one-line refusal
    "qk_norm": (True, "model.qk_norm=true"),
    "logit_softcap": (30.0, "model.logit_softcap=30.0: of the exported Hugging Face families only Gemma 2"),
    "bigram_vocab": (64, "model.bigram_vocab=64: none of the exported"),
}


@pytest.mark.parametrize("field", list(NOT_EXPORTABLE))
def test_a_model_no_family_can_hold_is_refused_and_nothing_is_written(tmp_path, field):
    value, message = NOT_EXPORTABLE[field]
    cfg = ModelConfig(**{**SMALL, "vocab_size": bpe().vocab_size, field: value})
    run = qkv.load(write_run(tmp_path / "run", cfg))
    with pytest.raises(QkvError, match=message):
        qkv.formats.hf.save(run, tmp_path / "hf")
    assert not (tmp_path / "hf").exists()
