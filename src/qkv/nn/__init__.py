"""PyTorch building blocks, one concept per file, each variant axis with its registry."""
