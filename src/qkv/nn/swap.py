"""Swapping layers of a finished model from outside, the way the parallel layouts wrap it: the model code
never knows. One mechanism for every kind of layer put in another's place (the decoding step's
DecodingLinear today; a quantized linear or a LoRA adapter the same way):

    swap(model, pick, make)              for good: returns the [(qualified name, old module)] replaced
    with swapped(model, pick, make):     for the duration: the old modules come back afterwards,
        ...                              also when the body raises

`pick(name, module) -> bool` chooses by qualified name (`blocks.3.attn.q_proj`) and module; `make(module)`
builds the replacement, which keeps the old parameters (or new ones: the state dict then changes with it).
A module shared by two parents (a tied head) is picked and made once per place it sits.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Iterator

from torch import nn
from torch.nn.modules import module as torch_module

from qkv.nn.changes import changed

Pick = Callable[[str, nn.Module], bool]
Make = Callable[[nn.Module], nn.Module]


def places(model: nn.Module, pick: Pick) -> list[tuple[nn.Module, str, str, nn.Module]]:
    """(parent, attribute, qualified name, module) of every picked module, in model.named_modules() order.
    The model itself is never swapped (it has no parent)."""
    found = []
    for parent_name, parent in model.named_modules(remove_duplicate=False):
        for attribute, child in parent.named_children():
            name = f"{parent_name}.{attribute}" if parent_name else attribute
            if pick(name, child):
                found.append((parent, attribute, name, child))
    return found


def put(parent: nn.Module, attribute: str, module: nn.Module) -> None:
    """setattr(parent, attribute, module) for an attribute that already holds a module: what nn.Module's
    __setattr__ does there, without its checks (2.5 us a layer, 1 ms of a generate call's 211 swaps in and
    out) where the parent's class and torch's global registration hooks leave nothing else for it to do."""
    hooks = getattr(torch_module, "_global_module_registration_hooks", True)  # (unknown to this torch: assume some)
    if type(parent).__setattr__ is nn.Module.__setattr__ and not hooks:
        parent._modules[attribute] = module
    else:
        setattr(parent, attribute, module)


def swap(model: nn.Module, pick: Pick, make: Make) -> list[tuple[str, nn.Module]]:
    """Put make(module) in the place of every module that `pick` chooses; the [(name, old module)] replaced."""
    chosen = places(model, pick)
    for parent, attribute, _, child in chosen:
        put(parent, attribute, in_mode_of(child, make(child)))
    changed()  # (counted: qkv.nn.changes)
    return [(name, child) for _, _, name, child in chosen]


def in_mode_of(old: nn.Module, new: nn.Module) -> nn.Module:
    """`new`, in `old`'s train / eval mode (a module is made in train mode; the model it joins may be in eval)."""
    if new is old or (not new._modules and new.training == old.training):  # (a layer without children: 0.2 ms
        return new  # of a generate call's swaps went to walking their empty subtrees)
    if any(module.training != old.training for module in new.modules()):
        new.train(old.training)
    return new


@contextmanager
def swapped(model: nn.Module, pick: Pick, make: Make) -> Iterator[nn.Module]:
    """`swap` for the duration of the with-block; every old module is put back afterwards."""
    chosen = places(model, pick)
    try:
        for parent, attribute, _, child in chosen:
            put(parent, attribute, in_mode_of(child, make(child)))
        changed()
        yield model
    finally:
        for parent, attribute, _, child in chosen:
            put(parent, attribute, child)
        changed()
