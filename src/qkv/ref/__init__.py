"""qkv.ref: the NumPy reference engine, every forward and backward written by hand (SPEC D).

Each layer is a pair `y, cache = f_forward(...)` / `dx, grads = f_backward(dy, cache)` with the formula of
note 000 LLM part §3 cited beside it; the model's backward calls the pairs in exactly the reverse order
and accumulates parameter gradients. Parameters are a dict keyed by the torch engine's state-dict names
(qkv.interop converts both ways). NumPy only, float64; nothing here imports torch.

    logits, cache = forward(params, cfg, input_ids)              # (B, T) -> (B, T, V)
    grads = backward(dlogits, cache, cfg)                         # {name: d loss / d param}
    loss, grads, logits = loss_and_grads(params, cfg, input_ids, targets)
    losses = train_ref(params, run_cfg, batches, steps)           # AdamW + schedule + clipping, no autograd
    gradcheck.check_fd(name) / gradcheck.CASES                    # the proofs, reusable by `qkv verify`

Covered: decoder-only LM with every positional (none, learned, sinusoidal, rope, alibi), norm (layernorm,
rmsnorm), placement (pre, post), activation (relu, gelu, gelu_tanh, silu, leaky_relu, relu6), FFN (mlp,
glu), MHA/GQA/MQA, tied or untied output, bias or not, padding masks; attention kernels naive/sdpa,
local, dilated, random (as masks), linear, tiled flash; cross-attention and the block with it; MoE
top-k FFN with its load-balancing loss; Adam, AdamW, SGD, the schedules of qkv.train.schedules,
global-norm clipping, gradient accumulation.
"""
from qkv.ref.model import ARCHITECTURES, backward, forward, loss_and_grads
from qkv.ref.train import train_ref, train_step

# What the reference engine does not do, each with the reason (also in docs/DEVIATIONS.md).
UNSUPPORTED = {
    "arch=encoder, arch=encoder-decoder": "the torch families are not in qkv.models yet; the layers they "
                                          "need (bidirectional and cross-attention, padding masks) are here "
                                          "and proved, and a family is one ARCHITECTURES entry",
    "dropout > 0": "the reference engine is deterministic; torch's dropout RNG cannot be reproduced",
    "moe_capacity_factor > 0": "routing without a capacity limit only (no token dropping)",
    "attention=linear with padding masks or score biases": "the O(n d^2) form needs masks that factor over "
                                                           "keys; only causal (prefix sums) is implemented",
    "KV-cache decoding": "the reference engine runs whole sequences (training and checking), not generation",
}

__all__ = ["ARCHITECTURES", "UNSUPPORTED", "backward", "forward", "loss_and_grads", "train_ref", "train_step"]
