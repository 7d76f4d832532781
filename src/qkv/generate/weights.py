"""The precision a model runs inference at: `--dtype fp32|bf16` (activations, and the weights left unquantized)
and `--quant none|int8|int4` (the linear layers' weights, qkv.nn.quant), shared by generate, chat, serve, eval
and explain; and `--kv-dtype fp32|bf16|fp16` (the decoder's KV cache, set_kv_dtype: generate, chat and serve).

    fp32, none   as trained or loaded (4 bytes a weight)
    bf16, none   every parameter in bf16; norms, softmax and RoPE still compute in fp32 inside the model
    *, int8      every linear layer's weight in int8 per output row (1 byte a weight + a scale a row)
    *, int4      every linear layer's weight in 4 bits per group of 32 (0.625 bytes a weight with its scale
                 and minimum: GGUF's Q4_1)
                 with either quant the output head stays above 4 bits: bf16 where the CPU has it natively,
                 else int8 (qkv.nn.quant.head_kind), and the products are bf16 where native

Without --quant (None) a GGUF file's quantized blocks run as shipped (qkv.formats.gguf.blocks: its 4-bit types
as int4 layers, the 5- to 8-bit ones as int8g), the products in bf16 where native; `--quant none` dequantizes
them to --dtype, `--quant int8 | int4` requantizes that. bf16 is for CPUs that multiply it natively (qkv.hardware); elsewhere it is emulated,
slower than fp32, and said so. With avx512_bf16 but no AMX, bf16 weights decode slower than fp32 (torch's
one-row bf16 products are no faster there) unless the compiled step's sums take them (the default of generate,
chat and serve; not with --no-compile), and that is said too.
"""
from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from qkv import hardware
from qkv.errors import QkvError
from qkv.heap import freed_buffers_returned
from qkv.formats import Run
from qkv.formats import load as load_any
from qkv.nn.decoding_linear import summed_form_known
from qkv.nn.embedding import QuantEmbedding, activations_of
from qkv.nn.fuse import fuse_projections
from qkv.nn.quant import (GROUP, QUANTS, Bf16Linear, QuantLinear, head_kind, head_of, kind_for, quantizable,
                          quantization_of, quantize_model)

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def check(dtype: str, quant: str, device: torch.device, compiled: bool = False) -> list[str]:
    """Refuse what cannot run; the warnings (lines) for what runs but slowly (`compiled`: decoding with the
    compiled step: the default, or --compile)."""
    if dtype not in DTYPES:
        raise QkvError(f"--dtype {dtype!r}: choose from {', '.join(DTYPES)}")
    if quant is not None and quant not in QUANTS:
        raise QkvError(f"--quant {quant!r}: choose from {', '.join(QUANTS)}")
    if quant not in (None, "none") and device.type != "cpu":
        raise QkvError(f"--quant {quant}: qkv's quantized kernels are CPU kernels; on {device.type} use --quant none "
                       "with --dtype bf16")
    warnings = []
    if dtype == "bf16" and device.type == "cpu" and not hardware.native_bf16_cpu():
        warnings.append("qkv: warning: --dtype bf16 on a CPU without native bf16 (no avx512_bf16, amx_bf16 or Arm "
                        "bf16): torch emulates it, slower than fp32")
    elif (dtype == "bf16" and quant in (None, "none") and device.type == "cpu" and hardware.native_bf16_cpu() == "avx512_bf16"
          and not (compiled and summed_form_known(torch.bfloat16))):
        # native_bf16_cpu names amx_bf16 first when a CPU has both, so "avx512_bf16" means x86 without AMX.
        # There torch's bf16 product for one row makes as many multiply-adds a second as fp32's (SmolLM2's
        # decode matrices 25-30 GB/s against 49-60; decode 29.6 against 38.5 tok/s, 2-core AMD EPYC,
        # docs/real-models.md); the compiled step's own sums read bf16 at twice fp32's speed where it takes them
        # (106.7 against 68.1 tok/s there); the quantized kinds keep their own kernels
        warnings.append("qkv: warning: --dtype bf16 on a CPU with avx512_bf16 but no AMX: torch's bf16 products for "
                        "one row run no faster than fp32's here, so decoding is slower than with --dtype fp32 "
                        "(prefill is faster)" + ("; the compiled step (without --no-compile) is faster" if
                                                   summed_form_known(torch.bfloat16) else ""))
    return warnings


KV_DTYPES = {**DTYPES, "fp16": torch.float16}  # a cache may also hold fp16


def set_kv_dtype(model: nn.Module, name: str | None) -> str | None:
    """`--kv-dtype`: the decoder's KV caches hold keys and values in fp32, bf16 or fp16 (None: the embedding's
    dtype, the default). Half the bytes a decoding step reads from the cache, rounded once as they are written
    (llama.cpp keeps fp16 by default, its `--cache-type-k` / `-v`); the attention itself still computes in
    fp32. A line saying so, or None when nothing changes; refused for a model without a decoder's cache."""
    if name is None:
        return None
    if name not in KV_DTYPES:
        raise QkvError(f"--kv-dtype {name!r}: choose from {', '.join(KV_DTYPES)}")
    if not hasattr(model, "kv_dtype"):
        raise QkvError(f"--kv-dtype applies to decoder-only models (their KV cache); this is a {type(model).__name__}")
    model.kv_dtype = KV_DTYPES[name] if KV_DTYPES[name] != activations_of(model)[0] else None
    if model.kv_dtype is None:
        return None
    return f"qkv: KV cache in {name} (keys and values rounded as they are written)"


def load(path: str | Path, *, dtype: str = "fp32", quant: str | None = None, device: str | torch.device = "cpu",
         stream: bool = True) -> Run:
    """qkv.formats.load(path) for inference at `dtype` / `quant`: where the format streams (GGUF), each block is
    converted as soon as it is read (convert_block), so a quantized model never holds all its weights in fp32;
    prepare does the rest. `quant` None (the default): a GGUF file's quantized blocks kept as shipped on the CPU
    (qkv.formats.gguf.load), elsewhere as "none"; "none": everything dequantized. `stream=False`: everything read
    in fp32 first (an adapter is merged before quantizing)."""
    shipped = quant is None and stream and torch.device(device).type == "cpu"
    with freed_buffers_returned():
        return load_any(path, device, convert=convert_block(dtype, quant or "none", device) if stream else None,
                        shipped=shipped)


def prepare(model: nn.Module, *, dtype: str = "fp32", quant: str | None = None, group: int = GROUP) -> str:
    """Put `model` (in eval, on the CPU for a quant) in the given precision, its Q/K/V and gate/up projections
    fused (qkv.nn.fuse), in place, for inference only; a one-line description.
    A model whose weights are already quantized (a run saved by `qkv convert --quant`) keeps them: asking for
    another quant is refused, since requantizing quantized weights adds error twice. A model loaded with
    `convert_block` (its blocks quantized as they were read) gets the rest: the head and any layer outside."""
    with freed_buffers_returned():
        return convert_model(model, dtype, quant or "none", group)


def convert_model(model: nn.Module, dtype: str, quant: str, group: int) -> str:
    held = quantization_of(model)
    if held == "gguf" or any(getattr(module, "origin", None) for module in model.modules()):
        description = shipped_description(model)
        cast_unquantized(model, DTYPES[dtype])
        fuse_projections(model)
        return f"{description}, {dtype} activations"
    if held != "none" and quant not in ("none", held):
        raise QkvError(f"this model holds {held} weights (qkv convert --quant {held}); --quant {quant} would "
                       f"requantize them: convert the original model instead")
    if held != "none" and not any(type(module) is nn.Linear for module in model.modules()):
        cast_unquantized(model, DTYPES[dtype])
        fuse_projections(model)
        return f"{held} weights (as saved; the head {head_of(model)}), {dtype} activations"
    if quant == "none":
        cast_unquantized(model, DTYPES[dtype])
        fuse_projections(model)
        return f"{dtype} weights"
    quantize_model(model, quant, group)  # from the fp32 weights (a Q4_1 file's to themselves), then the rest cast
    cast_unquantized(model, DTYPES[dtype])
    counts = {"int8": 0, "int4": 0}
    for module in model.modules():
        if isinstance(module, QuantLinear):
            counts[module.kind] += 1
    fuse_projections(model)
    layers = counts[quant] + (counts["int8"] if quant == "int4" else 0)
    odd = counts["int8"] - (head_of(model) == "int8") if quant == "int4" else 0
    return (f"{quant} weights{f', groups of {group}' if quant == 'int4' else ''} ({layers} linear layers"
            f"{f', {odd} in int8: shapes int4 cannot take' if odd else ''}; the head {head_of(model)}), "
            f"{dtype} activations")


def cast_unquantized(model: nn.Module, dtype: torch.dtype) -> None:
    """model.to(dtype) for every parameter and buffer but the quantized layers' (codes, fp32 scales and minima,
    a bf16 head): their precision is what they were saved at. A table looked up in a quantized head's blocks
    gives its rows in `dtype`."""
    for module in model.modules():
        if isinstance(module, QuantEmbedding):
            module.dtype = dtype
        if isinstance(module, (QuantLinear, Bf16Linear)):
            continue
        for name, p in module.named_parameters(recurse=False):
            if p.is_floating_point():
                p.data = p.data.to(dtype)
        for name, b in module.named_buffers(recurse=False):
            if b is not None and b.is_floating_point():
                setattr(module, name, b.to(dtype))


def shipped_description(model: nn.Module) -> str:
    """What a model holding a GGUF file's blocks runs (qkv.formats.gguf.blocks): the layers of each type."""
    types: dict[str, int] = {}
    for module in model.modules():
        if getattr(module, "origin", None):
            types[module.origin] = types.get(module.origin, 0) + 1
    head = getattr(getattr(model, "lm_head", None), "origin", None) or "unquantized"
    floats = sum(type(module) is nn.Linear for module in model.modules())
    table = getattr(model, "tok_emb", None)
    own = isinstance(table, QuantEmbedding) and table.blocks is not getattr(model, "lm_head", None)
    return (f"the file's quantized blocks as shipped ({', '.join(f'{n} {t}' for t, n in sorted(types.items()))} "
            f"linear layers{f', {floats} unquantized' if floats else ''}; the head {head}"
            f"{f', the embedding {table.blocks.origin}' if own else ''})")


def convert_block(dtype: str, quant: str, device: str | torch.device = "cpu", group: int = GROUP):
    """What a loader applies to each block as soon as its weights are read (formats.load(convert=...)), so that
    a quantized model never holds all its weights in fp32 at once; None where nothing would change or the
    model goes to another device (check refuses a quant there). prepare then does the rest (the head, the
    fused projections)."""
    if (dtype, quant) == ("fp32", "none") or torch.device(device).type != "cpu":
        return None

    def convert(block: nn.Module) -> None:
        if quant != "none":
            quantize_model(block, quant, group)  # a block holds no output head
        cast_unquantized(block, DTYPES[dtype])
    return convert


def round_weights(model: nn.Module, *, dtype: str = "fp32", quant: str = "none", group: int = GROUP) -> str | None:
    """Replace the model's fp32 weights by the values they hold at `dtype` / `quant` (quantized, then
    dequantized; rounded to bf16 and back), in place: for the float64 reference engine of `qkv explain`, whose
    numbers are then the quantized model's weights computed exactly. None when nothing changes."""
    if (dtype, quant) == ("fp32", "none"):
        return None
    if quantization_of(model) != "none":
        raise QkvError("this model holds quantized weights already; explain the model it was converted from")
    head = getattr(model, "lm_head", None)
    with torch.no_grad():
        if dtype == "bf16":
            for p in model.parameters():
                p.copy_(p.to(torch.bfloat16).float())
        if quant != "none":
            for name, module in model.named_modules():
                if quantizable(name, module):
                    kind = kind_for(quant, module, module is head, group)
                    if kind == "bf16":
                        module.weight.copy_(module.weight.to(torch.bfloat16).float())
                    else:
                        module.weight.copy_(QuantLinear.from_linear(module, kind, group).weight)
    if quant == "none":
        return f"{dtype} weights, the float64 engine computing with the values they hold"
    return (f"{quant} weights (the head {head_kind()}){', rounded to bf16' if dtype == 'bf16' else ''}, dequantized: "
            "the float64 engine computes with the values they hold")


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the model's parameters and buffers as held (a tied tensor once)."""
    seen, total = set(), 0
    for tensor in list(model.parameters()) + list(model.buffers()):
        if tensor.data_ptr() in seen:
            continue
        seen.add(tensor.data_ptr())
        total += tensor.numel() * tensor.element_size()
    return total
