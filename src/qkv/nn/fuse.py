"""Fused projections for inference: Q, K and V of a self-attention layer as one product, and the gate and up
projections of a GLU FFN as one. The math is the note's (three products of the same x; two of the same x);
the saving is in calls: a decoding step of a 30-layer model makes 90 matrix products instead of 150, and at a
few rows a product's fixed cost is a good part of its time.

    fuse_projections(model)     for every self-attention layer and GLU FFN: one layer whose weight is the
                                rows of the separate ones stacked, [W^Q; W^K; W^V] and [W_gate; W_up]; the
                                separate layers' weights (or int8/int4 codes and scales) become views of its
                                rows, so nothing is held twice and the state dict keeps its names

The fused layer is a plain attribute (`attn.fused_qkv`, `ffn.fused_gate_up`), not a submodule; the forward
uses it only where no hook sits on the separate layers (a hook must see its own layer run).
"""
from __future__ import annotations

import torch
from torch import nn

from qkv.nn.decoding_linear import DecodingLinear
from qkv.nn.quant import QuantLinear


# the fused layer's attribute, and the layers of one module it stands in for (in the order of its output rows)
FUSIONS = (("fused_qkv", ("q_proj", "k_proj", "v_proj")), ("fused_gate_up", ("gate_proj", "up_proj")))


def fuse_projections(model: nn.Module) -> int:
    """Fuse every self-attention layer's Q/K/V and every GLU's gate/up of `model` (in place, for inference);
    returns how many groups were fused. Layers of different kinds (a mix of int8 and int4) stay apart."""
    fused = 0
    for module in model.modules():
        for attribute, names in FUSIONS:
            if not all(hasattr(module, name) for name in names):
                continue
            one = fuse([getattr(module, name) for name in names])
            if one is not None:
                object.__setattr__(module, attribute, one)
                fused += 1
    return fused


def fuse(layers: list[nn.Module]) -> nn.Module | None:
    if all(type(layer) is nn.Linear for layer in layers):
        return fuse_linear(layers)
    if all(isinstance(layer, QuantLinear) for layer in layers) and len({(l.kind, l.group) for l in layers}) == 1:
        return fuse_quant(layers)
    return None


def fuse_linear(layers: list[nn.Linear]) -> nn.Module | None:
    if len({l.in_features for l in layers}) != 1 or len({l.bias is None for l in layers}) != 1:
        return None
    with torch.no_grad():
        weight = torch.cat([l.weight for l in layers])  # (sum of out, in)
        bias = None if layers[0].bias is None else torch.cat([l.bias for l in layers])
    one = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
    one.weight = nn.Parameter(weight, requires_grad=False)
    one.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
    start = 0
    for layer in layers:  # the separate layers now read rows of the fused weight: held once
        rows = slice(start, start + layer.out_features)
        layer.weight = nn.Parameter(one.weight[rows], requires_grad=layer.weight.requires_grad)
        if bias is not None:
            layer.bias = nn.Parameter(one.bias[rows], requires_grad=layer.bias.requires_grad)
        start += layer.out_features
    # the decode step's faster forms where they are the faster on this CPU (qkv.nn.decoding_linear)
    return DecodingLinear(one) if weight.device.type == "cpu" else one


def fuse_quant(layers: list[QuantLinear]) -> QuantLinear:
    first = layers[0]
    bias = None if first.bias is None else torch.cat([l.bias for l in layers])
    rows_at = 1 if first.kind == "int8g" else 0  # (int8g's codes are (G, out, g), maybe a view of (out, G, g))
    codes = (torch.cat([l.codes for l in layers], rows_at) if rows_at == 0 or first.codes.is_contiguous() else
             torch.cat([l.codes.transpose(0, 1) for l in layers]).transpose(0, 1))  # (its layout kept)
    one = QuantLinear(first.kind, first.in_features, sum(l.out_features for l in layers),
                      codes, torch.cat([l.scale for l in layers]),
                      None if first.low is None else torch.cat([l.low for l in layers]), bias)
    for form in ("compute_dtype", "dense_dtype", "native", "narrow"):  # the parts' forms (qkv.nn.quant)
        setattr(one, form, getattr(first, form))
    start = 0
    for layer in layers:
        rows = slice(start, start + layer.out_features)
        layer.codes, layer.scale = one.codes[(slice(None),) * rows_at + (rows,)], one.scale[rows]
        if layer.low is not None:
            layer.low = one.low[rows]
        layer._state_changed()
        start += layer.out_features
    return one
