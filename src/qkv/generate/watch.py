"""What a compiled decoding step (qkv.generate.compiled) assumes of its model between tokens, checked without
walking the model every token: no hooks anywhere on it, and the tensors its graphs were traced with still the
model's own.

The graphs hold the model's weights themselves (traced with TorchDynamo's install_free_tensors): a step no
longer reads some 300 weights and kernel operands out of the module tree by attribute every token, 0.25 ms of
an 8 ms SmolLM2 int8 token (2026-12-06, the AMD EPYC). A tensor written in place is still the one the graphs
hold (they read its values as they are then); one set anew in its place is not, and the step must not run on
the old one."""
from __future__ import annotations

from typing import Iterator

from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from qkv.nn.changes import changes, count_registrations
from qkv.nn.embedding import activations_of
from qkv.nn.fastpath import has_hooks
from qkv.nn.fuse import FUSIONS
from qkv.nn.quant import QuantLinear


def hooked(model: nn.Module) -> bool:
    """A hook anywhere on `model` (added before the step was built, or after: usable() asks every step, through
    ModelWatch)."""
    return any(has_hooks(module) for module in model.modules())


def layers(model: nn.Module) -> Iterator[tuple[nn.Module, bool]]:
    """(layer, runs) for every module of `model` (model.modules() order), each followed by the fused layers it
    holds as plain attributes (qkv.nn.fuse.FUSIONS); `runs` False for the layers a fused one stands in for (the
    step never runs them: its parent, seen first, names them)."""
    parts: set[int] = set()
    for module in model.modules():
        yield module, id(module) not in parts
        held = module.__dict__
        for fused, names in FUSIONS:
            if fused in held:
                parts.update(id(getattr(module, name)) for name in names)
                yield held[fused], True


def kernel_operands(model: nn.Module, make: bool = False) -> list[Tensor]:
    """The tensors the quantized layers' kernels read for the model's activations (their own layouts of the
    codes and scales, made at the first product, or now with `make`), fused layers included, the layers those
    stand in for not: plain tensors, not parameters, so torch.compile would take their sizes for variables unless
    told they are fixed."""
    found, operands = [], step_operands(model, make)
    for layer, runs in layers(model):
        if runs and isinstance(layer, QuantLinear):
            found += operands(layer)
    return found


def step_operands(model: nn.Module, make: bool = False):
    """QuantLinear -> the kernel operands it reads in the step (() where none were made and not `make`), for the
    activations' dtype its kernel takes: QuantLinear.forward's choice (compute_dtype, on the CPU), else the
    model's (the embedding's)."""
    dtype, device = activations_of(model)
    cpu = device.type == "cpu"

    def operands(layer: QuantLinear) -> tuple[Tensor, ...]:
        chosen = (layer.compute_dtype if cpu else None) or dtype
        found = layer.kernel_operands(chosen) if make else layer.kernel_cache().get(chosen, ())
        return tuple(tensor for tensor in found if tensor is not None)  # (int8g without minima)

    return operands


def held_tensors(model: nn.Module) -> tuple[list[Tensor], bool]:
    """Every tensor a compiled step's graphs hold (each layer's parameters and buffers, and the quantized products'
    kernel operands), and whether any layer has a hook: one walk (ModelWatch). The same tensors with the
    decoding step's layers swapped in or not: a DecodingLinear holds its nn.Linear's parameters, and neither
    registers a bias it lacks."""
    found, operands, hooks = [], step_operands(model), False
    for layer, runs in layers(model):
        found += layer._parameters.values()
        found += layer._buffers.values()
        if runs and isinstance(layer, QuantLinear):
            found += operands(layer)
        hooks = hooks or has_hooks(layer)
    return [tensor for tensor in found if tensor is not None], hooks


class ModelWatch:
    """`watch()`: whether a compiled step may run on the model now: no hooks on it (they must see their layers
    run) and the tensors its graphs hold (held_tensors, taken by hold() before the first trace) still in place.
    Walked again only when either could have changed: every hook torch registers (forward, backward, pre- or
    post-, on any module) takes a handle numbered from one counter (RemovableHandle.next_id), and every layer
    swapped in or back, parameter or buffer registered, and quantized layer's operands dropped is counted
    (qkv.nn.changes), so while both counts stand the model is as last seen. A model seen with hooks is walked
    every time (removing a hook takes no number). A model whose tensors were set anew takes the general step
    from then on (compiled.enable() again traces graphs for them). Modules set on the model by hand after its
    step was built are not covered (the graphs assume the modules they were traced with). SmolLM2's walk, once
    a generate call (its layers are swapped in and back): 0.7-1.0 ms, against 0.33 for the hooks' walk alone
    (2026-12-06, the AMD EPYC)."""

    def __init__(self, model: nn.Module):
        count_registrations()
        self.model = model
        self.stamp: tuple[int, int] | None = None
        self.hooked = True
        self.held: list[Tensor] | None = None  # None: no graph traced yet
        self.holds = True

    def __call__(self) -> bool:
        stamp = RemovableHandle.next_id, changes()
        if self.hooked or stamp != self.stamp:
            tensors, self.hooked = held_tensors(self.model)
            self.holds = self.held is None or same(tensors, self.held)
            self.stamp = stamp
        return not self.hooked and self.holds

    def hold(self) -> None:
        """The graphs about to be traced take the model's tensors as they are now."""
        self.held, self.holds = held_tensors(self.model)[0], True


def same(tensors: list[Tensor], held: list[Tensor]) -> bool:
    return len(tensors) == len(held) and all(a is b for a, b in zip(tensors, held))
