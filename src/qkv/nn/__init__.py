"""PyTorch building blocks, one concept per file, each variant axis with its registry."""

# every attention kernel registers itself in qkv.nn.kernels.KERNELS when its file is imported: importing any
# module of qkv.nn imports them all, in this order (flash before the sparse kinds that tile with it)
from qkv.nn import kernels, flash, linear_attention, sparse  # noqa: E402,F401,I001
