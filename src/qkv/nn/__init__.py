"""PyTorch building blocks, one concept per file, each variant axis with its registry."""

# The package is assembled here: every variant registers itself in its axis's registry when its file is
# imported, and importing any module of qkv.nn imports them all: the attention kernels in this order (flash
# before the sparse kinds that tile with it) into qkv.nn.kernels.KERNELS, and the relative encodings (Shaw,
# Transformer-XL, T5) into qkv.nn.positional.POSITIONALS.
from qkv.nn import kernels, flash, linear_attention, sparse  # noqa: E402,F401,I001
from qkv.nn import positional, relative  # noqa: E402,F401,I001
