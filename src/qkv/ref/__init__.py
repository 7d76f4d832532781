"""qkv.ref: the NumPy reference engine, every forward and backward written by hand (SPEC D).

Each layer is a pair `y, cache = f_forward(...)` / `dx = f_backward(dy, cache, grads)` with the formula of
note 000 LLM part §3 cited beside it: every backward returns its inputs' gradients and accumulates (+=) its
parameters' into `grads` (a `Grads` view of its scope, llm.c's form); the model's backward calls the pairs
in exactly the reverse order. Each cache is named (a NamedTuple beside its forward) where it has parts. Parameters are a dict keyed by the torch engine's state-dict names
(qkv.formats.params converts both ways). NumPy only, float64; nothing here imports torch.

    logits, cache = forward(params, cfg, input_ids)              # (B, T) -> (B, T, V)
    grads = backward(dlogits, cache, cfg)                         # {name: d loss / d param}
    loss, grads, logits = loss_and_grads(params, cfg, input_ids, targets)
    losses = train_ref(params, run_cfg, batches, steps)           # AdamW + schedule + clipping, no autograd
    gradcheck.check_fd(name) / gradcheck.CASES                    # the proofs, reusable by `qkv verify`

Covered, each equal to the torch engine in float64 (tests/ref/test_model.py: logits, loss, every gradient,
10 AdamW steps): the three families, decoder-only LM, encoder (bare hidden states, MLM head, classifier
head with first/mean pooling; token types, embed_norm, embed_scale) and encoder-decoder (cross-attention,
T5's causal twin in the decoder, tied or untied embeddings); every positional (none, learned, sinusoidal,
rope, alibi, shaw with key and value terms, xl with u / v / W_R, t5 and t5_causal bucketed biases), norm
(layernorm, rmsnorm), placement (pre, post, sandwich), activation (relu, gelu, gelu_tanh, silu, leaky_relu,
relu6, relu2), FFN (mlp, glu), MHA/GQA/MQA, QK-norm, tied or untied output, bias or not, padding masks; attention kernels
naive/sdpa, local, dilated, random (BigBird pattern, as masks), linear (O(n) causal/full, explicit form
with masks, biases or value terms), tiled flash (bias gradients and value terms included); MoE top-k FFN
with capacity limits and its load-balancing loss; Adam, AdamW, SGD, the schedules of qkv.schedules,
Muon (with AdamW for the non-matrix parameters), global-norm clipping, gradient accumulation.
"""
from qkv.ref.model import ARCHITECTURES, backward, forward, loss_and_grads
from qkv.ref.train import train_ref, train_step

# The package is assembled here: each of these registers its entries when imported, so importing any module
# of qkv.ref imports them all: the relative encodings into ref.positional.POSITIONALS, the "encoder" and
# "encoder-decoder" architectures into ref.model.ARCHITECTURES, the layer cases into ref.gradcheck.CASES.
from qkv.ref import relative, encoder, cases, cases_relative  # noqa: E402,F401,I001

# What the reference engine does not do, each with the reason (also in docs/DEVIATIONS.md).
UNSUPPORTED = {
    "dropout > 0": "the reference engine is deterministic; torch's dropout RNG cannot be reproduced",
    "KV-cache decoding (generation, Transformer-XL segment recurrence)": "the reference engine runs whole "
        "sequences (training and checking); a cached segment's memory is a torch KVCache, outside the "
        "engine, so XL's relative terms are covered within a segment only",
}

__all__ = ["ARCHITECTURES", "UNSUPPORTED", "backward", "forward", "loss_and_grads", "train_ref", "train_step"]
