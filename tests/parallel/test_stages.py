"""A pipeline stage's rewrites of the whole model (qkv.parallel.stages), in one process: `release` frees
every parameter outside the stage (meta: shape kept, no storage), keeps names, order and ties; `retie`
points the model's other references to a stage parameter's replacement."""
import torch
from torch import nn

from qkv.config import ModelConfig
from qkv.models import build_model
from qkv.parallel.stages import Stage, release, retie

CFG = ModelConfig(vocab_size=64, d_model=32, n_heads=4, n_layers=3, d_ff=64, max_seq_len=16)


def test_release_keeps_the_stage_and_frees_the_rest():
    torch.manual_seed(0)
    model = build_model(CFG)
    names = [name for name, _ in model.named_parameters()]
    shapes = [p.shape for p in model.parameters()]
    last = Stage(model, range(2, 3), first=False, last=True, tokens=8)
    keep = {id(p) for p in last.parameters()}
    release(model, keep)
    assert [name for name, _ in model.named_parameters()] == names  # the tied W_E still appears once
    assert [p.shape for p in model.parameters()] == shapes
    held = {name for name, p in model.named_parameters() if not p.is_meta}
    assert held == {name for name, p in model.named_parameters() if id(p) in keep}
    assert model.tok_emb.weight is model.lm_head.weight and not model.lm_head.weight.is_meta  # tied, kept
    assert all(p.is_meta for p in model.blocks[0].parameters())
    torch.manual_seed(0)
    whole = build_model(CFG)  # the same weights
    first = Stage(whole, range(0, 2), first=True, last=False, tokens=8)
    ids = torch.randint(CFG.vocab_size, (2, 8))
    torch.testing.assert_close(last(first(ids)), whole(ids), rtol=1e-6, atol=1e-6)  # the kept stage computes


def test_retie_points_every_reference_to_the_replacement():
    model = build_model(CFG)
    last = Stage(model, range(2, 3), first=False, last=True, tokens=8)
    entries = {(id(m), n): p for m in model.modules() for n, p in m._parameters.items() if p is not None}
    new = nn.Parameter(model.lm_head.weight.detach().clone())
    last.lm_head._parameters["weight"] = new  # what FSDP2 does to the stage's copy
    assert model.tok_emb.weight is not new
    retie(model, last, entries)
    assert model.tok_emb.weight is new and model.lm_head.weight is new
    assert sum(1 for _ in model.parameters()) == sum(1 for _ in build_model(CFG).parameters())
