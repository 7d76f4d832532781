"""qkv.nn.swap: layers of a finished model replaced from outside, by qualified name, and put back."""
import pytest
import torch
from torch import nn

import qkv
from qkv.nn.swap import places, swap, swapped


class Scaled(nn.Module):
    """A stand-in layer: the wrapped linear's output times 2 (so a swap is visible in the logits)."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return 2 * self.inner(x)


def tiny():
    torch.manual_seed(0)
    cfg = qkv.ModelConfig(vocab_size=32, d_model=16, n_heads=2, n_layers=2, d_ff=32, max_seq_len=16)
    return qkv.build_model(cfg).eval()


def test_places_are_picked_by_qualified_name():
    model = tiny()
    names = [name for _, _, name, _ in places(model, lambda name, m: name.endswith("attn.q_proj"))]
    assert names == ["blocks.0.attn.q_proj", "blocks.1.attn.q_proj"]
    assert all(dict(model.named_modules())[name] is module
               for _, _, name, module in places(model, lambda name, m: isinstance(m, nn.Linear)))


def test_swapped_changes_the_output_and_puts_every_module_back_after_an_error():
    model = tiny()
    ids = torch.tensor([[1, 2, 3, 4]])
    before = model(ids)
    originals = dict(model.named_modules())
    pick = lambda name, m: name.endswith("lm_head")  # noqa: E731
    with pytest.raises(RuntimeError), swapped(model, pick, Scaled):
        torch.testing.assert_close(model(ids), 2 * before, rtol=0, atol=1e-5)  # logits = h W^T, doubled
        raise RuntimeError("a failing step")
    assert all(dict(model.named_modules())[name] is module for name, module in originals.items())
    assert torch.equal(model(ids), before)


def test_swap_is_for_good_and_returns_what_it_replaced():
    model = tiny()
    ids = torch.tensor([[5, 6, 7]])
    before = model(ids)
    replaced = swap(model, lambda name, m: name == "lm_head", Scaled)
    assert [name for name, _ in replaced] == ["lm_head"] and type(model.lm_head) is Scaled
    assert model.lm_head.inner is replaced[0][1]
    torch.testing.assert_close(model(ids), 2 * before, rtol=0, atol=1e-5)
    assert swap(model, lambda name, m: False, Scaled) == []


def test_a_layer_put_in_takes_the_mode_of_the_one_it_replaces():
    """A module is made in train mode; put into a model in eval mode it is in eval mode too (else every generate
    call would switch it: qkv.generate.decode.eval_mode), and in train mode in a training model."""
    model = tiny()  # eval
    swap(model, lambda name, m: name == "lm_head", Scaled)
    assert not model.lm_head.training and not model.lm_head.inner.training
    model.train()
    with swapped(model, lambda name, m: name.endswith("attn.q_proj"), Scaled):
        assert all(m.training for m in model.modules())
    model.eval()
    with swapped(model, lambda name, m: name.endswith("attn.q_proj"), Scaled):
        assert not any(m.training for m in model.modules())


def test_a_swap_still_calls_torchs_module_registration_hooks_where_there_are_some():
    """put() writes the parent's child dict directly only where nn.Module.__setattr__ would do nothing more: a
    global registration hook (torch.nn.modules.module.register_module_module_registration_hook) still sees each
    module put in and put back."""
    from torch.nn.modules.module import register_module_module_registration_hook

    model = tiny()
    seen = []
    handle = register_module_module_registration_hook(lambda parent, name, module: seen.append((name, module)))
    try:
        with swapped(model, lambda name, m: name.endswith("attn.q_proj"), Scaled):
            assert [type(module) for name, module in seen if name == "q_proj"] == [Scaled, Scaled]
    finally:
        handle.remove()
    put = [type(module) for name, module in seen if name == "q_proj"]  # (Scaled's own `inner` is seen too)
    assert put == [Scaled, Scaled, nn.Linear, nn.Linear]
    assert type(model.blocks[0].attn.q_proj) is nn.Linear


def test_a_childless_layer_put_in_takes_the_mode_of_the_one_it_replaces_too():
    """in_mode_of's short way for a layer without children (a DecodingLinear) still sets its mode."""
    model = tiny()  # eval
    swap(model, lambda name, m: name == "lm_head", lambda m: nn.Linear(m.in_features, m.out_features))
    assert not model.lm_head.training
    model.train()
    fresh = nn.Linear(16, 16).eval()
    with swapped(model, lambda name, m: name == "blocks.0.attn.q_proj", lambda m: fresh):
        assert model.blocks[0].attn.q_proj is fresh and fresh.training


class Recording(nn.Module):
    """A parent whose own __setattr__ must see every module set on it."""

    def __init__(self):
        super().__init__()
        self.names = []
        self.child = nn.Linear(2, 2)

    def __setattr__(self, name, value):
        if isinstance(value, nn.Module):
            self.names.append(name)
        super().__setattr__(name, value)


def test_a_parent_with_its_own_setattr_sees_each_module_put_in_and_back():
    parent = Recording()
    parent.names.clear()
    with swapped(parent, lambda name, m: name == "child", Scaled):
        assert type(parent.child) is Scaled
    assert parent.names == ["child", "child"] and type(parent.child) is nn.Linear
