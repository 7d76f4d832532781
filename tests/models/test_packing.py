"""Packed documents (qkv.models.context `documents`): each document of a packed row gets exactly the outputs it
gets alone in a row of its own, for every positional encoding and the decoder variants qkv trains."""
import dataclasses

import pytest
import torch

from qkv.config import ModelConfig
from qkv.models import build_model
from qkv.models.context import document_mask, document_positions
from qkv.nn.positional import POSITIONALS

VARIANTS = {
    **{f"positional={name}": {"positional": name} for name in POSITIONALS.names()},
    "llama (rope, rmsnorm, swiglu, gqa)": {"positional": "rope", "norm": "rmsnorm", "ffn": "glu",
                                          "activation": "silu", "n_kv_heads": 2},
    "qwen2 (biases)": {"positional": "rope", "norm": "rmsnorm", "ffn": "glu", "activation": "silu", "bias": True},
    "bigram embedding": {"bigram_vocab": 64},
    "moe": {"moe_experts": 4, "moe_top_k": 2},
    "post-ln": {"norm_placement": "post"},
}
LENGTHS = [[5, 7, 4], [9, 3, 2, 2]]  # two rows of 16 tokens, packed


def packed(lengths_per_row, vocab, seed=0):
    generator = torch.Generator().manual_seed(seed)
    rows, documents, pieces = [], [], []
    for lengths in lengths_per_row:
        docs = [torch.randint(0, vocab, (n,), generator=generator) for n in lengths]
        pieces.append(docs)
        rows.append(torch.cat(docs))
        documents.append(torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)]))
    return torch.stack(rows), torch.stack(documents), pieces


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_each_packed_document_equals_it_alone(variant, tiny_cfg):
    cfg = dataclasses.replace(tiny_cfg, **VARIANTS[variant])
    torch.manual_seed(0)
    model = build_model(cfg).eval()
    ids, documents, pieces = packed(LENGTHS, cfg.vocab_size)
    with torch.no_grad():
        together = model(ids, documents=documents)  # (2, 16, V)
        for row, docs in enumerate(pieces):
            start = 0
            for doc in docs:
                alone = model(doc[None])[0]  # (n, V)
                torch.testing.assert_close(together[row, start:start + len(doc)], alone, rtol=1e-5, atol=1e-5)
                start += len(doc)


def test_packing_differs_from_plain_concatenation(tiny_cfg):
    """The oracle above can fail: without the documents the later documents see the earlier ones."""
    model = build_model(dataclasses.replace(tiny_cfg, positional="rope")).eval()
    ids, documents, pieces = packed(LENGTHS, tiny_cfg.vocab_size)
    with torch.no_grad():
        plain, alone = model(ids), model(pieces[0][1][None])[0]
    assert (plain[0, 5:12] - alone).abs().max() > 1e-3


def test_positions_restart_and_the_mask_is_block_causal():
    documents = torch.tensor([[0, 0, 0, 1, 1, 2]])
    assert document_positions(documents).tolist() == [[0, 1, 2, 0, 1, 0]]
    mask = document_mask(documents, None, causal=True)[0, 0].int()
    expected = torch.tensor([[1, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0], [1, 1, 1, 0, 0, 0],
                             [0, 0, 0, 1, 0, 0], [0, 0, 0, 1, 1, 0], [0, 0, 0, 0, 0, 1]])
    assert torch.equal(mask, expected)


def test_documents_refuse_a_cache(tiny_cfg):
    model = build_model(tiny_cfg).eval()
    with pytest.raises(ValueError, match="KV cache"):
        ids = torch.zeros(1, 4, dtype=torch.long)
        model(ids, cache=model.new_cache(1, 8), documents=torch.zeros_like(ids))
