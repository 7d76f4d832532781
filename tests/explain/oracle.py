"""The torch engine's own values for what `qkv explain` shows: one fp32 forward with hooks and a test
kernel that forms S and A explicitly (retaining their gradients), then torch autograd's backward of the
same one-token loss. Nothing here uses the reference engine."""
from __future__ import annotations

import functools

import numpy as np
import torch
import torch.nn.functional as F

from qkv.analysis.record import blocks_of
from qkv.formats.params import torch_forward
from qkv.nn import sparse
from qkv.nn.attention import Attention
from qkv.nn.kernels import weighted_values

ATTENTION_FIELDS = ("q", "k", "v", "scores", "weights", "heads")


def _kernel(records: list, slot: int, layer: Attention):
    patterns = {"local": sparse.local_pattern, "dilated": sparse.dilated_pattern}

    def kernel(q, k, v, *, mask, causal, bias, scale, dropout=0.0, value_bias=None):
        T, S = q.shape[-2], k.shape[-2]
        scores = q @ k.transpose(-1, -2) * scale + (0 if bias is None else bias)  # (B, H, T, S)
        allowed = mask
        if layer.kernel_name in patterns:  # the sparse pattern as a mask (qkv.nn.sparse's own rule)
            pattern = functools.partial(patterns[layer.kernel_name], window=layer.window)
            allowed = sparse.pattern_mask(pattern, T, S, mask, causal, q.device)
        if allowed is None and causal:
            allowed = torch.ones(T, S, dtype=torch.bool).tril(S - T)
        masked = scores if allowed is None else scores.masked_fill(~allowed, float("-inf"))
        weights = torch.softmax(masked, dim=-1)
        out = weighted_values(weights, v, value_bias, 0.0)
        for t in (q, k, v, scores, weights, out):
            t.retain_grad()
        records[slot] = dict(zip(ATTENTION_FIELDS, (q, k, v, scores, weights, out)))
        return out
    return kernel


def _keep(store: dict, key: str):
    def hook(module, args, output):
        output.retain_grad()
        store[key] = output
    return hook


def _keep_input(store: dict, key: str):
    def hook(module, args):
        args[0].retain_grad()
        store[key] = args[0]
    return hook


def oracle(model: torch.nn.Module, inputs: tuple, position: int | None, target: int) -> dict:
    """{name: float64 array} under the page's names (batch axis dropped), from torch alone."""
    model.eval()
    layers = [m for m in model.modules() if isinstance(m, Attention)]
    records: list = [None] * len(layers)
    saved = [layer.kernel for layer in layers]
    store, handles = {}, []
    blocks = blocks_of(model)
    for n, block in enumerate(blocks):
        handles.append(block.register_forward_pre_hook(_keep_input(store, f"{n}.stream_in")))
        handles.append(block.register_forward_hook(_keep(store, f"{n}.stream_out")))
        for part in ("attn", "cross_attn", "ffn"):
            module = getattr(block, part, None)
            if module is None:
                continue
            handles.append(module.register_forward_hook(_keep(store, f"{n}.{part}.output")))
            norm = getattr(block, {"attn": "attn_norm", "cross_attn": "cross_norm", "ffn": "ffn_norm"}[part])
            if not hasattr(norm, "inner"):
                handles.append(norm.register_forward_hook(_keep(store, f"{n}.{part}.norm.output")))
                handles.append(norm.register_forward_pre_hook(_keep_input(store, f"{n}.{part}.norm.input")))
            if hasattr(module, "down_proj"):
                handles.append(module.down_proj.register_forward_pre_hook(_keep_input(store, f"{n}.ffn.hidden")))
                first = module.gate_proj if hasattr(module, "gate_proj") else module.up_proj
                handles.append(first.register_forward_hook(_keep(store, f"{n}.ffn.pre")))
            if hasattr(module, "o_proj"):
                handles.append(module.o_proj.register_forward_pre_hook(_keep_input(store, f"{n}.{part}.merged")))
    finals = [m for name, m in model.named_modules() if name in ("final_norm", "encoder.final_norm")]
    final = [m for name, m in model.named_modules() if name == "final_norm"] or finals
    if final:
        handles.append(final[0].register_forward_hook(_keep(store, "output.hidden")))
    for name, module in model.named_modules():
        if name == "head.norm":  # BERT's MLM head: LN(act(H W_t + b_t))
            handles.append(module.register_forward_hook(_keep(store, "output.mlm_norm")))
        if name == "head.transform":
            handles.append(module.register_forward_hook(lambda m, a, out: store.__setitem__("output.mlm_pre", out)))
        if name.endswith("ffn.router"):
            handles.append(module.register_forward_hook(_keep(store, f"{name.split('.')[-3]}.ffn.router_logits")))
    for slot, layer in enumerate(layers):
        layer.kernel = _kernel(records, slot, layer)
    try:
        model.zero_grad(set_to_none=True)
        logits = torch_forward(model, inputs)
        logits.retain_grad()
        row = logits[0] if position is None else logits[0, position]
        loss = F.cross_entropy(row[None], torch.tensor([target]))
        loss.backward()
    finally:
        for layer, kernel in zip(layers, saved):
            layer.kernel = kernel
        for handle in handles:
            handle.remove()
    return _names(model, blocks, layers, records, store, logits, position, loss, inputs)


def _np(t: torch.Tensor) -> np.ndarray:
    return t.detach().double().numpy()[0]


GRADS = {"stream_in": "d_stream_in", "stream_out": "d_stream_out", "output": "d_output", "norm.output": "norm.d_output",
         "hidden": "d_hidden"}  # store key's last part -> the page's name of its gradient


def _names(model, blocks, layers, records, store, logits, position, loss, inputs) -> dict:
    out = {"loss": np.array(loss.item())}
    owner = {id(m): (n, part) for n, block in enumerate(blocks) for part in ("attn", "cross_attn")
             if (m := getattr(block, part, None)) is not None}
    for layer, record in zip(layers, records):
        n, part = owner[id(layer)]
        for field, tensor in record.items():
            if field != "heads":
                out[f"{n}.{part}.{field}"] = _np(tensor)
            out[f"{n}.{part}.d_{field}"] = _np(tensor.grad)
    for key, tensor in store.items():
        if key in ("output.hidden", "output.mlm_norm"):
            out[key] = _np(tensor)
            continue
        if key == "output.mlm_pre":
            out["output.mlm_transform"] = _np(model.head.activation(tensor))
            continue
        if key.endswith("router_logits"):  # p = softmax(x W_r)
            out[key.replace("router_logits", "router_probs")] = torch.softmax(tensor, dim=-1).detach().double().numpy()
            continue
        n, _, rest = key.partition(".")
        if rest == "ffn.pre":
            continue
        name = {"stream_in": "attn.stream_in", "stream_out": "ffn.stream_out"}.get(rest, rest)
        out[f"{n}.{name}"] = _np(tensor)
        part, _, leaf = name.partition(".")
        if leaf in GRADS and tensor.grad is not None:
            out[f"{n}.{part}.{GRADS[leaf]}"] = _np(tensor.grad)
    for n, block in enumerate(blocks):
        pre = store.get(f"{n}.ffn.pre")
        if pre is not None and hasattr(block.ffn, "act"):  # act'(A1) by autograd, elementwise
            x = pre.detach().clone().requires_grad_(True)
            block.ffn.act(x).sum().backward()
            out[f"{n}.ffn.activation_grad"] = x.grad.double().numpy()[0]
        out[f"{n}.grad_norm"] = np.array(float(torch.sqrt(sum((p.grad.double() ** 2).sum()
                                                              for p in block.parameters() if p.grad is not None))))
    row = (lambda t: t[0]) if position is None else (lambda t: t[0, position])
    out["output.logits"] = row(logits).detach().double().numpy()
    out["output.d_logits"] = row(logits.grad).double().numpy()
    hidden = store.get("output.hidden")
    if hidden is not None and hidden.grad is not None:  # dL/dH^L at the head's input, by autograd
        out["output.d_hidden"] = _np(hidden.grad)
    return out
