"""Every variant axis of ModelConfig and the registry that names its choices."""
from __future__ import annotations

from qkv.nn.ffn import ACTIVATIONS, FFNS
from qkv.nn.init import INITS
from qkv.nn.kernels import KERNELS
from qkv.nn.norms import NORMS
from qkv.nn.positional import POSITIONALS
from qkv.nn.residual import RESIDUALS
from qkv.registry import Registry

AXES: dict[str, Registry] = {
    "positional": POSITIONALS,
    "norm": NORMS,
    "norm_placement": RESIDUALS,
    "activation": ACTIVATIONS,
    "ffn": FFNS,
    "attention": KERNELS,
    "init": INITS,
}


def get(axis: str) -> Registry:
    return AXES[axis]
