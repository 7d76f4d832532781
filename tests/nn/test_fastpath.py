"""qkv.nn.fastpath: the questions the fast paths ask before bypassing a module's call."""
import sys

import torch
from torch import nn

from qkv.nn.fastpath import has_hooks, is_dtensor


def test_has_hooks_sees_every_kind_of_hook():
    for register in ("register_forward_hook", "register_forward_pre_hook", "register_full_backward_hook",
                     "register_full_backward_pre_hook"):
        layer = nn.Linear(2, 2)
        assert not has_hooks(layer)
        handle = getattr(layer, register)(lambda *args: None)
        assert has_hooks(layer), register
        handle.remove()
        assert not has_hooks(layer)


def test_a_plain_tensor_is_not_a_dtensor_and_nothing_is_imported_to_say_so():
    imported = "torch.distributed.tensor" in sys.modules
    assert not is_dtensor(torch.zeros(2))
    assert ("torch.distributed.tensor" in sys.modules) == imported
