import torch

# The torch oracles run tiny tensors: one intra-op thread avoids OpenMP spin contention on shared cores
# (measured: a 2-layer D=8 model's 11 forward/backward passes take 0.08 s with one thread, 1-4 s with two).
torch.set_num_threads(1)
