"""qkv.formats.gguf: a GGUF file (llama, qwen2 or gpt2) read by qkv gives the logits transformers' own GGUF loader gives for the same
file, for every tensor type the gguf package writes (and K-quant blocks with random finite scales), tied and
untied heads, grouped-query and full attention; its chat template and turn-ending ids come along."""
import numpy as np
import pytest
import torch

import qkv
from qkv.formats.gguf.archs import permute, unpermute
from tests.formats.gguf import (TEMPLATE, ggml_rows, gguf, small_tokenizer, transformers_logits, write_gpt2,
                               write_llama)

IDS = torch.tensor([[1, 5, 9, 40, 100, 7, 250, 3], [2, 2, 60, 61, 62, 63, 64, 65]])
TOL = 1e-4  # fp32, both dequantized by the gguf package: only the order of float additions differs


@pytest.mark.parametrize("qtype", ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"])
def test_logits_equal_transformers_gguf_loader(tmp_path, qtype):
    path = write_llama(tmp_path / f"{qtype}.gguf", qtype=qtype, seed=1)
    run = qkv.load(path)
    with torch.no_grad():
        ours = run.model(IDS)
    assert (ours - transformers_logits(path, IDS)).abs().max().item() < TOL


@pytest.mark.parametrize("tied, kv_heads", [(True, 2), (False, 4), (True, 1)])
def test_tied_heads_and_every_kv_grouping(tmp_path, tied, kv_heads):
    path = write_llama(tmp_path / "m.gguf", tied=tied, kv_heads=kv_heads, seed=2)
    run = qkv.load(path)
    assert run.config.model.tie_embeddings == tied and run.config.model.kv_heads == kv_heads
    with torch.no_grad():
        assert (run.model(IDS) - transformers_logits(path, IDS)).abs().max().item() < TOL


@pytest.mark.parametrize("qtype", ["Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"])
def test_k_quant_blocks_with_random_finite_scales(tmp_path, qtype):
    """The gguf package writes no K-quants: every matrix is random blocks of bytes below 0x40, so that each
    fp16 scale in them is finite and small (|x| < 2) whatever the block layout; read by both loaders."""
    rng = np.random.default_rng(3)
    kind = gguf.GGMLQuantizationType[qtype]
    block, size = gguf.GGML_QUANT_SIZES[kind]

    def blocks(name, w):
        return rng.integers(0, 0x40, size=(w.shape[0], w.shape[1] // block * size), dtype=np.uint8), kind

    path = write_llama(tmp_path / f"{qtype}.gguf", seed=3, width=256, ffn=512, raw=blocks, layers=1)
    run = qkv.load(path)
    with torch.no_grad():
        ours, theirs = run.model(IDS), transformers_logits(path, IDS)
    assert torch.isfinite(theirs).all() and (ours - theirs).abs().max().item() <= 1e-5 * theirs.abs().max().item()


@pytest.mark.parametrize("qtype, tied", [("F32", True), ("Q8_0", False)])
def test_gpt2_logits_equal_transformers_gguf_loader(tmp_path, qtype, tied):
    path = write_gpt2(tmp_path / "g.gguf", qtype=qtype, tied=tied, seed=5)
    run = qkv.load(path)
    assert run.config.model.positional == "learned" and run.config.model.tie_embeddings == tied
    with torch.no_grad():
        assert (run.model(IDS) - transformers_logits(path, IDS)).abs().max().item() < TOL


@pytest.mark.parametrize("qtype", ["F32", "Q8_0"])
def test_qwen2_logits_equal_transformers_gguf_loader(tmp_path, qtype):
    path = write_llama(tmp_path / "q.gguf", qtype=qtype, arch="qwen2", seed=8)
    run = qkv.load(path)
    assert run.config.model.bias
    with torch.no_grad():
        assert (run.model(IDS) - transformers_logits(path, IDS)).abs().max().item() < TOL


def test_unpermute_undoes_llama_cpps_permutation():
    w = np.arange(4 * 16 * 3, dtype=np.float32).reshape(4 * 16, 3)
    assert np.array_equal(unpermute(ggml_rows(w, 4), 4), w) and np.array_equal(permute(w, 4), ggml_rows(w, 4))


def test_the_chat_template_and_turn_ending_ids_come_from_the_metadata(tmp_path):
    run = qkv.load(write_llama(tmp_path / "m.gguf"))
    tokens, _, _ = small_tokenizer()
    assert run.chat.template == TEMPLATE and run.chat.bos_token == "<|im_start|>"
    assert run.chat.stop_ids == (tokens.index("<|im_end|>"),)
    assert run.stop_ids == (run.tokenizer.eos_id, tokens.index("<|im_end|>"))
