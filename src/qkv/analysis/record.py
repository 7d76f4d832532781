"""Recording what a model computes, from outside the model (STYLE.md 12: no output flags in forward).

`attention_maps(model, ids)` uses record_attention, which swaps every attention layer's
kernel (a plain function attribute of qkv.nn.attention.Attention) for one that forms the explicit
A = softmax(Q K^T / sqrt(d_k) + M) (note 000 §14.1) that layer's kernel computes, and restores them.

`layer_grad_norms(cfg)` is the gradient norm of each layer's parameters at initialisation
(claim 31, `qkv plot gradnorm`).
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch import nn

from qkv.nn.attention import Attention
from qkv.nn.kernels import recording_kernel, weights_for
from qkv.models import build_model


@contextlib.contextmanager
def record_attention(model: torch.nn.Module) -> Iterator[list]:
    """Record the attention weights of every attention layer (note 000 §14; SPEC A9), without flags:

        with record_attention(model) as maps:
            model(ids)
        maps[layer]  # (B, H, T, S) weights of the layer-th attention module (model.modules() order) in its
                     # latest call; cross-attention modules count as layers too

    Each layer's kernel is swapped for one that forms the weights its own kernel computes (the sparse
    kinds with their pattern, linear attention its normalised feature-map products) and restored after.
    """
    layers = [m for m in model.modules() if isinstance(m, Attention)]
    records: list = [None] * len(layers)
    saved = [layer.kernel for layer in layers]
    for slot, layer in enumerate(layers):
        layer.kernel = recording_kernel(weights_for(layer.kernel_name, window=layer.window), records, slot)
    try:
        yield records
    finally:
        for layer, kernel in zip(layers, saved):
            layer.kernel = kernel


def attention_layers(model: nn.Module) -> list[tuple[str, Attention]]:
    """(name, layer) for every attention layer, in module order (self- and cross-attention)."""
    return [(name, module) for name, module in model.named_modules() if isinstance(module, Attention)]


def attention_maps(model: nn.Module, input_ids: torch.Tensor, target_ids: torch.Tensor | None = None
                   ) -> dict[str, torch.Tensor]:
    """{layer name: (H, T, S)} for one sequence (1, T) through a decoder or encoder (an encoder-decoder
    also takes target_ids), recorded by record_attention (each layer's kernel swapped for
    one that also forms A)."""
    model.eval()
    names = [name for name, _ in attention_layers(model)]  # model.modules() order, as the records
    inputs = (input_ids,) if target_ids is None else (input_ids, target_ids)
    with torch.no_grad(), record_attention(model) as records:
        model(*inputs)
    return {name: weights[0].float().cpu() for name, weights in zip(names, records) if weights is not None}


def blocks_of(model: nn.Module) -> list[nn.Module]:
    """The model's layers in order: every `blocks` ModuleList, encoder's first."""
    return [block for name, module in model.named_modules() if name.endswith("blocks")
            for block in module]


def layer_grad_norms(cfg, *, seed: int = 0, batch: int = 4, seq: int = 32) -> list[float]:
    """||d loss / d theta_l||_2 for the parameters of each layer l, at initialisation, for a random batch
    (a decoder's next-token cross-entropy)."""
    torch.manual_seed(seed)
    model = build_model(cfg)
    ids = torch.randint(0, cfg.vocab_size, (batch, seq + 1))
    logits = model(ids[:, :-1])
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())
    loss.backward()
    return [float(torch.sqrt(sum((p.grad.double() ** 2).sum() for p in block.parameters())))
            for block in blocks_of(model)]
