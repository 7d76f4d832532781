"""Activation checkpointing from outside the model (SPEC B7; note 000 LLM §6.2): the same gradients as without,
fewer bytes kept for the backward, the same parameter names, applied by the Trainer."""
import dataclasses

import pytest
import torch

from qkv.models import build_model
from qkv.nn.linear_cross_entropy import cross_entropy
from qkv.parallel.memory import apply_activation_checkpointing
from tests.train.test_loop import trainer


def grads_of(model, x, y) -> dict[str, torch.Tensor]:
    torch.manual_seed(1)  # the dropout masks
    cross_entropy(model(x), y).backward()
    return {name: p.grad.clone() for name, p in model.named_parameters()}


def pair(tiny_cfg, **changes):
    cfg = dataclasses.replace(tiny_cfg, **changes)
    plain = build_model(cfg)
    wrapped = build_model(cfg)
    wrapped.load_state_dict(plain.state_dict())
    return plain, wrapped


@pytest.mark.parametrize("changes", [dict(), dict(dropout=0.1), dict(moe_experts=2, moe_top_k=1),
                                     dict(arch="encoder-decoder"), dict(save_attention=True)])
def test_gradients_identical_to_without(tiny_cfg, changes):
    save_attention = changes.pop("save_attention", False)
    plain, wrapped = pair(tiny_cfg, **changes)
    assert apply_activation_checkpointing(wrapped, save_attention=save_attention) == len([m for m in wrapped.modules() if type(m).__name__ == "Block"])
    g = torch.Generator().manual_seed(0)
    x, y = torch.randint(0, 32, (2, 3, 16), generator=g)
    if changes.get("arch") == "encoder-decoder":
        plain_grads, wrapped_grads = (grads_on_pairs(m, x, y) for m in (plain, wrapped))
    else:
        plain_grads, wrapped_grads = grads_of(plain, x, y), grads_of(wrapped, x, y)
    assert plain_grads.keys() == wrapped_grads.keys()
    for name, grad in plain_grads.items():
        torch.testing.assert_close(wrapped_grads[name], grad, rtol=0, atol=1e-6, msg=name)


def grads_on_pairs(model, src, tgt) -> dict[str, torch.Tensor]:
    torch.manual_seed(1)
    cross_entropy(model(src, tgt), tgt).backward()
    return {name: p.grad.clone() for name, p in model.named_parameters()}


def saved_bytes(model, x, y) -> int:
    """Bytes the autograd graph keeps for the backward, counted as they are saved (outside checkpoints)."""
    total = 0

    def pack(tensor):
        nonlocal total
        total += tensor.numel() * tensor.element_size()
        return tensor
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        cross_entropy(model(x), y)
    return total


def test_kept_activations_shrink_to_the_block_inputs(tiny_cfg):
    cfg = dataclasses.replace(tiny_cfg, n_layers=4, max_seq_len=64)
    plain, wrapped = pair(cfg)
    apply_activation_checkpointing(wrapped)
    x, y = torch.randint(0, 32, (2, 4, 64))
    before, after = saved_bytes(plain, x, y), saved_bytes(wrapped, x, y)
    block_inputs = 4 * x.numel() * cfg.d_model * 4  # one (B, T, D) fp32 input per block
    assert after < before / 3
    assert after - block_inputs < before / 4  # what remains is the embedding, final norm and head


def test_names_generation_and_the_trainer(tmp_path, tiny_cfg):
    plain, wrapped = pair(tiny_cfg)
    apply_activation_checkpointing(wrapped)
    apply_activation_checkpointing(wrapped)  # twice is once
    assert list(wrapped.state_dict()) == list(plain.state_dict())
    x = torch.randint(0, 32, (1, 5))
    with torch.no_grad():
        torch.testing.assert_close(wrapped(x), plain(x), rtol=0, atol=0)
    t = trainer(tmp_path, activation_checkpointing=True)
    assert all(getattr(block, "activation_checkpointing", False) for block in t.model.blocks)
    assert t.run()["steps"] == t.tc.max_steps
