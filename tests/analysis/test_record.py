"""Recording from outside the model (qkv.analysis.record): the attention maps are softmax(Q K^T / sqrt(Dh) + M)
recomputed by hand from the layer's own projections, rows sum to 1, the causal mask holds, the model's
kernels come back; per-layer gradient norms equal autograd's on the same batch. record_attention(model): every
layer's and head's weights, with no output flag in forward (SPEC A9)."""
import dataclasses
import math

import pytest
import torch

import qkv
from qkv.config import ModelConfig
from qkv.analysis.record import attention_layers, attention_maps, blocks_of, layer_grad_norms, record_attention
from qkv.models import build_model
from qkv.nn.kernels import KERNELS

CFG = dict(vocab_size=30, d_model=16, n_heads=2, n_layers=2, d_ff=32, max_seq_len=16, positional="learned")


def test_first_layer_map_is_the_softmax_of_its_own_scores():
    torch.manual_seed(0)
    model = qkv.build_model(qkv.ModelConfig(**CFG))
    ids = torch.randint(0, 30, (1, 9))
    kernels = [layer.kernel for _, layer in attention_layers(model)]
    maps = attention_maps(model, ids)
    assert list(maps) == [name for name, _ in attention_layers(model)]
    assert [layer.kernel for _, layer in attention_layers(model)] == kernels  # restored
    # layer 0 by hand: x = E[ids] + P, LN, Q K^T / sqrt(Dh) with the causal mask
    block = model.blocks[0]
    with torch.no_grad():
        x = model.tok_emb(ids) + model.positional.weight[:9]
        h = block.attn_norm(x)  # pre-LN
        attn = block.attn
        q = attn.q_proj(h).view(1, 9, 2, 8).transpose(1, 2)
        k = attn.k_proj(h).view(1, 9, 2, 8).transpose(1, 2)
        scores = q @ k.transpose(-2, -1) / math.sqrt(8)
        scores = scores.masked_fill(~torch.ones(9, 9, dtype=torch.bool).tril(), float("-inf"))
    first = maps[next(iter(maps))]
    assert first.shape == (2, 9, 9)
    torch.testing.assert_close(first, scores.softmax(-1)[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(first.sum(-1), torch.ones(2, 9))
    assert torch.all(first.triu(1) == 0)  # no query reads a later key


def test_layer_grad_norms_are_autograds():
    cfg = qkv.ModelConfig(**CFG)
    norms = layer_grad_norms(cfg, seed=3, batch=2, seq=8)
    torch.manual_seed(3)
    model = qkv.build_model(cfg)
    ids = torch.randint(0, 30, (2, 9))
    torch.nn.functional.cross_entropy(model(ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten()).backward()
    want = [torch.cat([p.grad.flatten() for p in block.parameters()]).norm().item() for block in blocks_of(model)]
    assert len(norms) == 2 and norms == pytest.approx(want, rel=1e-6)


@pytest.mark.parametrize("kernel", ["sdpa", "naive", "flash"])
def test_attention_maps_from_the_recording_kernel(kernel):
    cfg = ModelConfig(vocab_size=50, d_model=32, n_heads=4, n_layers=2, d_ff=64, attention=kernel)
    model = qkv.build_model(cfg).eval()
    ids = torch.randint(0, 50, (1, 9), generator=torch.Generator().manual_seed(0))
    kernels = [block.attn.kernel for block in model.blocks]
    before = model(ids)
    maps = attention_maps(model, ids)
    assert list(maps) == ["blocks.0.attn", "blocks.1.attn"]
    for weights in maps.values():
        assert weights.shape == (4, 9, 9)
        assert torch.allclose(weights.sum(-1), torch.ones(4, 9), atol=1e-5)
        assert weights.triu(1).abs().max() == 0  # causal: no query sees a later key
    assert torch.equal(model(ids), before)
    assert [block.attn.kernel for block in model.blocks] == kernels


def test_attention_maps_of_encoder_families():
    cfg = ModelConfig(arch="encoder-decoder", vocab_size=50, d_model=32, n_heads=4, n_layers=1, d_ff=64)
    src, tgt = torch.randint(0, 50, (2, 1, 6), generator=torch.Generator().manual_seed(0))
    maps = attention_maps(qkv.build_model(cfg), src, tgt[:, :5])
    assert list(maps) == ["encoder.blocks.0.attn", "blocks.0.attn", "blocks.0.cross_attn"]
    assert maps["encoder.blocks.0.attn"].triu(1).abs().max() > 0  # bidirectional
    assert maps["blocks.0.cross_attn"].shape == (4, 5, 6)  # target queries over source keys
    for weights in maps.values():
        assert torch.allclose(weights.sum(-1), torch.ones(weights.shape[:-1]), atol=1e-5)


RECORD_CFG = ModelConfig(vocab_size=32, d_model=16, n_heads=4, n_layers=2, d_ff=32, max_seq_len=32, window=1)


def model_for(**changes):
    torch.manual_seed(0)
    return build_model(dataclasses.replace(RECORD_CFG, **changes)).eval()


@pytest.mark.parametrize("kernel", KERNELS.names())
def test_recording_changes_no_output_and_restores_the_kernels(kernel):
    model = model_for(attention=kernel, positional="shaw")  # with a value term too
    ids = torch.randint(0, 32, (2, 6))
    kernels = [block.attn.kernel for block in model.blocks]
    with torch.no_grad():
        plain = model(ids)
        with record_attention(model) as maps:
            recorded = model(ids)
    torch.testing.assert_close(recorded, plain, rtol=1e-5, atol=1e-5)
    assert [block.attn.kernel for block in model.blocks] == kernels
    assert len(maps) == 2 and all(m.shape == (2, 4, 6, 6) for m in maps)
    for weights in maps:
        torch.testing.assert_close(weights.sum(-1), torch.ones(2, 4, 6))
        assert torch.equal(weights.triu(1), torch.zeros_like(weights))  # causal


def test_recorded_weights_are_the_layers_softmax():
    """Layer 0's map equals softmax(Q K^T / sqrt(Dh) + causal mask) from its own projections."""
    model = model_for(attention="sdpa", positional="none")
    ids = torch.randint(0, 32, (1, 5))
    with torch.no_grad(), record_attention(model) as maps:
        model(ids)
        block = model.blocks[0]
        x = block.attn_norm(model.tok_emb(ids))
        q = block.attn.q_proj(x).view(1, 5, 4, 4).transpose(1, 2)
        k = block.attn.k_proj(x).view(1, 5, 4, 4).transpose(1, 2)
        scores = (q @ k.transpose(-2, -1) / math.sqrt(4)).masked_fill(torch.ones(5, 5).triu(1).bool(), -math.inf)
    torch.testing.assert_close(maps[0], scores.softmax(-1), rtol=1e-5, atol=1e-6)


def test_a_local_layer_records_its_band():
    model = model_for(attention="local", window=1)
    with torch.no_grad(), record_attention(model) as maps:
        model(torch.randint(0, 32, (1, 6)))
    band = torch.ones(6, 6).tril().triu(-1).bool()  # j in {i - 1, i}
    assert torch.equal(maps[1][0, 0] > 0, band)
