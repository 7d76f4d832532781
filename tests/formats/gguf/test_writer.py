"""qkv.formats.gguf.writer (`qkv convert RUN --to-gguf`): runs trained by qkv (llama and gpt2 shapes, their own
BPE tokenizer) written as GGUF files that transformers' GGUF loader reads with the run's logits (f32 within
1e-4; q8_0 and q4_0 within their quantization error, as large as qkv's own reading of the file says) and its
tokenizer's ids; qkv reads them back; an existing file is never overwritten."""
import pytest
import torch
import transformers

import qkv
from qkv.config import ModelConfig, RunConfig
from qkv.data.tokenizer import Tokenizer
from qkv.formats import run_dir
from qkv.formats.base import Chat, Run
from tests.cli.test_main import assert_one_error_line, cli
from tests.formats.gguf import TEMPLATE, TEXT, transformers_logits

SHAPES = {"llama": dict(positional="rope", norm="rmsnorm", ffn="glu", activation="silu", bias=False, n_kv_heads=2,
                        tie_embeddings=False, d_ff=128),
          "gpt2": dict(positional="learned", norm="layernorm", ffn="mlp", activation="gelu_tanh", bias=True,
                       tie_embeddings=True, d_ff=256)}  # transformers' GGUF loader takes GPT-2's FFN as 4 D


def qkv_run(tmp_path, shape: str) -> Run:
    """A qkv run of this shape with its own trained BPE tokenizer, saved as a run dir."""
    tokenizer = Tokenizer.train(TEXT, 300)
    cfg = ModelConfig(vocab_size=tokenizer.vocab_size, d_model=64, n_heads=4, n_layers=2, max_seq_len=1024,
                      init_std=0.1, **SHAPES[shape])
    torch.manual_seed(7)
    run = Run(path=tmp_path / shape, config=RunConfig(model=cfg), model=qkv.build_model(cfg).eval(),
              tokenizer=tokenizer, chat=Chat(template=TEMPLATE))
    return qkv.load(run_dir.save(run, tmp_path / shape))


@pytest.mark.parametrize("shape", ["llama", "gpt2"])
def test_f32_files_have_the_runs_logits_in_transformers_and_in_qkv(tmp_path, capsys, shape):
    run = qkv_run(tmp_path, shape)
    out = tmp_path / f"{shape}.gguf"
    assert cli(capsys, "convert", run.path, "--to-gguf", out)[0] == 0
    ids = torch.tensor([[run.tokenizer.eos_id] + run.tokenizer.encode("Whether 'tis nobler in the mind")])
    with torch.no_grad():
        expected = run.model(ids)
        back = qkv.load(out)
        assert (back.model(ids) - expected).abs().max().item() == 0.0
    assert (transformers_logits(out, ids) - expected).abs().max().item() < 1e-4
    assert back.chat.template == TEMPLATE
    theirs = transformers.AutoTokenizer.from_pretrained(str(out.parent), gguf_file=out.name)
    for text in TEXT[:4] + ["a  b\n\n c", "🙂 naïve"]:
        assert theirs(text, add_special_tokens=False).input_ids == run.tokenizer.encode(text)


# measured on this run (2026-12-04): f16 0.00072, bf16 0.0072, q8_0 0.023, q4_0 0.32 of the largest logit
@pytest.mark.parametrize("dtype, bound", [("f16", 2e-3), ("bf16", 2e-2), ("q8_0", 5e-2), ("q4_0", 0.6)])
def test_quantized_files_are_read_alike_by_both_loaders(tmp_path, capsys, dtype, bound):
    """The two loaders agree on the file (1e-4); the file departs from the fp32 run by its quantization error,
    at most `bound` of the largest logit (measured: docs/real-models.md)."""
    run = qkv_run(tmp_path, "llama")
    out = tmp_path / f"{dtype}.gguf"
    assert cli(capsys, "convert", run.path, "--to-gguf", out, "--dtype", dtype)[0] == 0
    ids = torch.tensor([[run.tokenizer.eos_id] + run.tokenizer.encode("The slings and arrows")])
    with torch.no_grad():
        expected, ours = run.model(ids), qkv.load(out).model(ids)
    assert (transformers_logits(out, ids) - ours).abs().max().item() < 1e-4
    assert 0 < (ours - expected).abs().max().item() <= bound * expected.abs().max().item()


def test_refusals_leave_everything_as_it_was(tmp_path, capsys):
    run = qkv_run(tmp_path, "llama")
    existing = tmp_path / "there.gguf"
    existing.write_bytes(b"mine")
    assert_one_error_line(*cli(capsys, "convert", run.path, "--to-gguf", existing), "already exists")
    assert existing.read_bytes() == b"mine"
    assert_one_error_line(*cli(capsys, "convert", run.path, "--to-hf", tmp_path / "x", "--dtype", "q8_0"),
                          "--dtype applies to --to-gguf")
    encoder = qkv.build_model(ModelConfig(arch="encoder", vocab_size=run.tokenizer.vocab_size, d_model=32,
                                          n_heads=4, n_layers=1, d_ff=64, max_seq_len=32))
    path = run_dir.save(Run(path=tmp_path / "enc", config=RunConfig(model=encoder_cfg(run)), model=encoder,
                            tokenizer=run.tokenizer), tmp_path / "enc")
    assert_one_error_line(*cli(capsys, "convert", path, "--to-gguf", tmp_path / "e.gguf"), "")
    assert not (tmp_path / "e.gguf").exists() and sorted(p.name for p in tmp_path.glob(".*tmp")) == []


def encoder_cfg(run):
    return ModelConfig(arch="encoder", vocab_size=run.tokenizer.vocab_size, d_model=32, n_heads=4, n_layers=1,
                       d_ff=64, max_seq_len=32)
