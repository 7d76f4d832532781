"""Measurements that the calculators are checked against (tests/analysis, benchmarks/calc_vs_measured.py,
`qkv verify`): FLOPs from torch.utils.flop_counter and peak tensor memory of a training step on CPU.

CPU torch keeps no allocator statistics (no torch.cuda.max_memory_allocated), so `LiveBytes` counts them
itself: a TorchDispatchMode that sees every tensor an op returns, adds its storage's bytes when the
storage is new, and subtracts them when the storage is freed (a weak reference's callback), as
torch.distributed._tools.mem_tracker does. Storages alive before the mode (weights, optimizer states)
are the baseline and counted once.
"""
from __future__ import annotations

import weakref
from typing import Callable, Iterable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import FlopCounterMode


class LiveBytes(TorchDispatchMode):
    """Peak bytes of the tensor storages alive at once, beyond `existing` ones (counted in `baseline`)."""

    def __init__(self, existing: Iterable[torch.Tensor] = ()):
        super().__init__()
        self.known: set[int] = set()
        self.baseline = 0
        for tensor in existing:
            storage = getattr(tensor, "_local_tensor", tensor).untyped_storage()
            if storage._cdata not in self.known:
                self.known.add(storage._cdata)
                self.baseline += storage.nbytes()
        self.live: dict[int, tuple[weakref.ref, int]] = {}
        self.current = self.peak = 0

    def _freed(self, key: int, _ref) -> None:
        _, nbytes = self.live.pop(key)
        self.current -= nbytes

    def _track(self, tensor: torch.Tensor) -> None:
        tensor = getattr(tensor, "_local_tensor", tensor)  # a DTensor's shard on this rank
        storage = tensor.untyped_storage()
        key = storage._cdata
        if key in self.known or key in self.live:
            return
        ref = weakref.ref(storage, lambda r, key=key: self._freed(key, r))
        self.live[key] = (ref, storage.nbytes())
        self.current += storage.nbytes()
        self.peak = max(self.peak, self.current)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for item in tree_flatten(out)[0]:
            if isinstance(item, torch.Tensor) and item.device.type == "cpu":
                self._track(item)
        return out

    @property
    def peak_total(self) -> int:
        return self.baseline + self.peak


def optimizer_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]


def peak_step_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: Callable[[], None]) -> dict:
    """Run `step` (forward, backward, optimizer step, zero_grad(set_to_none)) once to create the
    optimizer states, then again inside LiveBytes. Returns the baseline (weights + states) and the peak."""
    step()
    existing = [p for p in model.parameters()] + optimizer_tensors(optimizer)
    with LiveBytes(existing) as mode:
        step()
    return {"baseline": mode.baseline, "peak": mode.peak_total}


def count_flops(fn: Callable[[], object]) -> tuple[int, dict[str, int]]:
    """Total FLOPs torch.utils.flop_counter counts while `fn` runs, and per aten op."""
    with FlopCounterMode(display=False) as counter:
        fn()
    per_op = {str(op): n for op, n in counter.get_flop_counts()["Global"].items()}
    return counter.get_total_flops(), per_op


def saved_for_backward_bytes(run: Callable[[], object]) -> int:
    """Bytes of the tensors autograd saves for the backward while `run()` builds its graph (each saved
    tensor counted once per save, inputs included), via torch.autograd.graph.saved_tensors_hooks."""
    saved: list[int] = []

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        saved.append(tensor.numel() * tensor.element_size())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        run()
    return sum(saved)
