"""Whether a module has hooks: the fast paths that bypass a module's call (the chunked head + loss, the
decoding layers) step aside for a module with hooks, so that its hooks still run."""
from __future__ import annotations

from torch import nn


def has_hooks(module: nn.Module) -> bool:
    return bool(module._forward_hooks or module._forward_pre_hooks or module._backward_hooks
                or module._backward_pre_hooks)
