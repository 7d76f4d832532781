"""record_attention(model): every layer's and head's weights, with no output flag in forward (SPEC A9)."""
import dataclasses
import math

import pytest
import torch

from qkv.config import ModelConfig
from qkv.models import build_model
from qkv.nn.kernels import KERNELS, record_attention

CFG = ModelConfig(vocab_size=32, d_model=16, n_heads=4, n_layers=2, d_ff=32, max_seq_len=32, window=1)


def model_for(**changes):
    torch.manual_seed(0)
    return build_model(dataclasses.replace(CFG, **changes)).eval()


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
