"""The guards of the fast paths: what they ask before they bypass the general path.

`has_hooks`: the fast paths that bypass a module's call (the chunked head + loss, the decoding layers) step
aside for a module with hooks, so that its hooks still run. `is_dtensor`: a tensor sharded by tensor
parallel or FSDP2 (qkv.parallel.layout) takes the general path too.
"""
from __future__ import annotations

import sys

from torch import Tensor, nn


def has_hooks(module: nn.Module) -> bool:
    return bool(module._forward_hooks or module._forward_pre_hooks or module._backward_hooks
                or module._backward_pre_hooks)


def fused_or_none(module: nn.Module, attribute: str, *parts: nn.Module) -> nn.Module | None:
    """The fused layer qkv.nn.fuse set on `module` (a plain attribute), if there is one and no hook sits on
    the parts it stands in for (a hook must see its own layer run)."""
    one = module.__dict__.get(attribute)
    if one is None or any(has_hooks(part) for part in parts):
        return None
    return one


def is_dtensor(tensor: Tensor) -> bool:
    """A DTensor? Without importing torch.distributed.tensor (a second): unloaded, nothing can be one."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(tensor, module.DTensor)
