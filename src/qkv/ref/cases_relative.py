"""Layer cases for the learnt and content-dependent score biases (Shaw key and value terms, Transformer-XL,
T5), the kernels' bias and value-term gradients (naive, tiled flash, linear's explicit form), the random
kernel under padding, and the sandwich block. Same sizes as qkv.ref.cases; each attention case feeds the
positional parameters in as inputs, so finite differences and torch autograd check their gradients too."""
from __future__ import annotations

import numpy as np

from qkv.ref import kernels
from qkv.ref.attention import AttentionContext, attention_backward, attention_forward
from qkv.ref.cases import B, D, Dh, H, T, _block_case, _kernel_case, _normal, attention_params, cfg
from qkv.ref.flash import flash_backward, flash_forward
from qkv.ref.functional import scope
from qkv.ref.gradcheck import CASES, Case, layer_grads
from qkv.ref.positional import POSITIONALS

MAX_DISTANCE = 2  # Shaw's clip k: smaller than T, so clipping is exercised

POSITIONAL_SHAPES = {
    "shaw": {"key_table.weight": (2 * MAX_DISTANCE + 1, Dh), "value_table.weight": (2 * MAX_DISTANCE + 1, Dh)},
    "xl": {"r_proj.weight": (H * Dh, D), "content_bias": (H, Dh), "position_bias": (H, Dh)},
    "t5": {"relative_attention_bias.weight": (32, H)},
    "t5_causal": {"relative_attention_bias.weight": (32, H)},
}

_flash_tiny = kernels.Kernel(lambda *a, **k: flash_forward(*a, **k, block=2), flash_backward)


def padding_mask(causal: bool) -> np.ndarray:
    """Row 0 left-padded by two; every query keeps its own column (qkv.ref.model.positions_and_mask)."""
    keep = np.ones((B, T), dtype=bool)
    keep[0, :2] = False
    allowed = keep[:, None, None, :]
    if causal:
        allowed = allowed & kernels.causal_mask(T, T)
    return allowed | np.eye(T, dtype=bool)


def relative_attention_case(name: str, kernel: str = "naive", *, causal: bool = True, mask: bool = False):
    """Self-attention with positional `name`: inputs x, the projections and positional.* (B=2, T=5)."""
    def make_kernel():
        return _flash_tiny if kernel == "flash" else kernels.KERNELS.get(kernel)(cfg())

    def inputs(rng):
        values = {"x": _normal(rng, B, T, D), **attention_params(rng)}
        for param, shape in POSITIONAL_SHAPES[name].items():
            values[f"positional.{param}"] = _normal(rng, *shape, scale=0.5)
        return values

    def forward(i):
        positions = np.broadcast_to(np.arange(T), (B, T))
        ctx = AttentionContext(POSITIONALS.get(name)(cfg(max_distance=MAX_DISTANCE)), positions, positions,
                               padding_mask(causal) if mask else None, causal and not mask, make_kernel(), H,
                               params=scope(i, "positional"))
        y, cache = attention_forward(i, i["x"], ctx)
        return y, (cache, ctx)

    def backward(dy, c):
        cache, _ = c  # the encoding's tables get their gradients under ctx.positional_prefix
        return layer_grads(attention_backward, dy, cache)

    return Case(inputs, forward, backward)


RELATIVE_CASES = {  # case name -> (positional, kernel, causal, padded)
    "relative_shaw": ("shaw", "naive", True, False),
    "relative_shaw_bidirectional_padding": ("shaw", "naive", False, True),
    "relative_shaw_flash": ("shaw", "flash", True, True),
    "relative_shaw_linear": ("shaw", "linear", False, False),
    "relative_xl": ("xl", "naive", True, False),
    "relative_xl_bidirectional_flash": ("xl", "flash", False, True),
    "relative_t5": ("t5", "naive", False, True),
    "relative_t5_causal_flash": ("t5_causal", "flash", True, False),
    "relative_t5_linear_padding": ("t5", "linear", True, True),
}
for _case, (_name, _kernel, _causal, _padded) in RELATIVE_CASES.items():
    CASES.register(_case)(relative_attention_case(_name, _kernel, causal=_causal, mask=_padded))

CASES.register("kernel_random_padding")(_kernel_case(lambda: kernels.KERNELS.get("random")(cfg(window=1)), mask=True))
CASES.register("kernel_linear_padding_bias")(_kernel_case(lambda: kernels.KERNELS.get("linear")(cfg()), mask=True,
                                                          bias=True))
CASES.register("block_sandwich_layernorm")(_block_case("sandwich", "layernorm"))

# ---- MoE with a capacity limit: dropped routes add nothing and get no gradient --------------------

from qkv.ref.cases import _moe_inputs  # noqa: E402
from qkv.ref.moe import moe_backward, moe_forward  # noqa: E402

CASES.register("moe_top2_capacity")(Case(
    _moe_inputs,
    lambda i: moe_forward(i, i["x"], ffn="glu", activation="silu", experts=3, top_k=2, capacity_factor=0.5),
    lambda dy, c: layer_grads(moe_backward, dy, c)))
