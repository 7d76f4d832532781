"""One count of the changes to any model that a compiled decoding step must look at again
(qkv.generate.watch.ModelWatch): a layer swapped in or put back (qkv.nn.swap), a parameter or buffer registered
on any module (set anew: `layer.weight = nn.Parameter(...)`, load_state_dict(assign=True), a layer built), and a
quantized layer's kernel operands dropped (new codes: qkv.nn.quant). While the count stands, none of these
happened. A tensor written into a module's dict by hand (`module._parameters[name] = ...`) is not counted."""
from __future__ import annotations

from torch.nn.modules import module as torch_module

_count = 0
_counting_registrations = False


def changes() -> int:
    """How many counted changes there were so far, over all models."""
    return _count


def changed(*_: object) -> None:
    """Count one change (also torch's registration hooks' signature: module, name, tensor)."""
    global _count
    _count += 1


def count_registrations() -> None:
    """From now on, count every parameter and buffer registered on any module (torch's global registration hooks;
    installed once a process, by the first compiled step)."""
    global _counting_registrations
    if not _counting_registrations:
        torch_module.register_module_parameter_registration_hook(changed)
        torch_module.register_module_buffer_registration_hook(changed)
        _counting_registrations = True
