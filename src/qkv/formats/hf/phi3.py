"""Phi-3 (transformers' modeling_phi3.py; Phi-3-mini-4k and its kin) <-> qkv's decoder LM: LLaMA's math with
fused tensors. `qkv_proj` holds W^Q, W^K, W^V stacked (H Dh + 2 Hkv Dh rows) and `gate_up_proj` the gate and
up projections (2 F rows, the gate first): split on reading (qkv writes the model as Mistral, or LLaMA without a
window: the same function, unfused). A `sliding_window` makes
every layer sliding (Phi-3-mini-4k: 2,047 keys). Phi-3's 128k models scale RoPE by `longrope`: one divisor a
pair, a short set within the original context and a long one past it (qkv.rope_scaling). A `partial_rotary_factor` below 1
(Phi-4-mini: 0.75) turns only each head's first dimensions: model.rope_dims, Q's and K's rows put in qkv's
layout (qkv.formats.hf.rope.partial_rows)."""
from __future__ import annotations

import math

import torch

from qkv.config import ModelConfig
from qkv.errors import QkvError
from qkv.formats.hf import llama
from qkv.formats.hf.common import HF_FAMILIES, HfFamily, Tensors, ensure
from qkv.formats.hf.rope import partial_rows

ARCHITECTURE = "Phi3ForCausalLM"


def config(hf: dict, architecture: str) -> ModelConfig:
    params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    ensure(isinstance(params, dict), f"rope_parameters={params!r} must be an object")
    factor = params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    head_dim = hf.get("head_dim") or (hf.get("hidden_size") or 0) // max(hf.get("num_attention_heads") or 1, 1)
    rotated = round(factor * head_dim) if isinstance(factor, (int, float)) and not isinstance(factor, bool) else -1
    ensure(0 < factor <= 1 and rotated % 2 == 0 and rotated >= 2,
           f"partial_rotary_factor={factor!r} must turn an even number of each head's {head_dim} dimensions")
    window = hf.get("sliding_window") or 0
    ensure(isinstance(window, int) and window >= 0, f"sliding_window={window!r} must be a positive integer or null")
    n_layers = hf.get("num_hidden_layers") or 0
    sliding = {"layer_types": ("sliding",) * n_layers, "sliding_window": window} if window else {}
    partial = {"rope_dims": rotated} if rotated != head_dim else {}  # Phi-4-mini: 0.75
    params = {k: v for k, v in params.items() if k != "partial_rotary_factor"}
    longrope = {}
    if params.get("rope_type", params.get("type")) == "longrope":
        longrope = longrope_fields(hf, params, rotated)
        params = {"rope_type": "default", "rope_theta": params.get("rope_theta", hf.get("rope_theta", 10000.0))}
    return llama.config({**hf, "rope_parameters": params or None}, architecture, **sliding, **partial, **longrope)


def longrope_fields(hf: dict, params: dict, rotated: int) -> dict:
    """Phi-3 128k's longrope as transformers computes it (modeling_rope_utils._compute_longrope_parameters): the
    divisors of the turned pairs, short and long, the original context, and the cos / sin factor m, given or
    sqrt(1 + ln s / ln L) with s = max_position_embeddings / L."""
    original = params.get("original_max_position_embeddings") or hf.get("original_max_position_embeddings")
    ensure(isinstance(original, int) and original > 0, "longrope needs original_max_position_embeddings")
    sets = [params.get(name) for name in ("long_factor", "short_factor")]
    ensure(all(isinstance(s, list) and len(s) == rotated // 2 and all(isinstance(f, (int, float)) and f > 0 for f in s)
               for s in sets), f"longrope's long_factor and short_factor must hold {rotated // 2} positive numbers each")
    factor = params.get("factor") or hf.get("max_position_embeddings", original) / original
    m = params.get("attention_factor") or (1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original)))
    return {"rope_scaling": "longrope", "rope_original_context": original, "rope_attention_factor": float(m),
            "rope_long_factors": tuple(map(float, sets[0])), "rope_short_factors": tuple(map(float, sets[1]))}


def split(tensors: Tensors, cfg: ModelConfig) -> Tensors:
    """qkv_proj -> q_proj, k_proj, v_proj; gate_up_proj -> gate_proj, up_proj (LLaMA's names)."""
    q, kv = cfg.n_heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
    out = {}
    for name, tensor in tensors.items():
        if name.endswith("self_attn.qkv_proj.weight"):
            stem = name.removesuffix("qkv_proj.weight")
            if tensor.shape[0] != q + 2 * kv:
                raise QkvError(f"{name} has {tensor.shape[0]} rows; the heads need {q + 2 * kv}")
            out[stem + "q_proj.weight"], out[stem + "k_proj.weight"], out[stem + "v_proj.weight"] = \
                torch.split(tensor, (q, kv, kv))
        elif name.endswith("mlp.gate_up_proj.weight"):
            stem = name.removesuffix("gate_up_proj.weight")
            if tensor.shape[0] != 2 * cfg.d_ff:
                raise QkvError(f"{name} has {tensor.shape[0]} rows; the FFN needs {2 * cfg.d_ff}")
            out[stem + "gate_proj.weight"], out[stem + "up_proj.weight"] = torch.split(tensor, cfg.d_ff)
        else:
            out[name] = tensor
    return out


def to_qkv(tensors: Tensors, cfg: ModelConfig) -> Tensors:
    """The split tensors, Q's and K's rows in qkv's layout of a partial rotation (rope.partial_rows)."""
    out = split(tensors, cfg)
    for name in out:
        heads = cfg.n_heads if name.endswith("q_proj.weight") else cfg.kv_heads if name.endswith("k_proj.weight") else 0
        if heads and cfg.rope_dims:
            out[name] = partial_rows(out[name], heads, cfg.head_dim, cfg.rope_dims)
    return llama.to_qkv(out, cfg)


def to_hf(tensors: Tensors, cfg: ModelConfig) -> Tensors:
    out = llama.to_hf(tensors, cfg)
    for i in range(cfg.n_layers):
        stem = f"model.layers.{i}."
        out[stem + "self_attn.qkv_proj.weight"] = torch.cat([out.pop(stem + f"self_attn.{n}_proj.weight") for n in "qkv"])
        out[stem + "mlp.gate_up_proj.weight"] = torch.cat([out.pop(stem + f"mlp.{n}_proj.weight") for n in ("gate", "up")])
    return out


HF_FAMILIES.register("phi3")(HfFamily(
    model_type="phi3", architectures=(ARCHITECTURE,), config=config, to_qkv=to_qkv, hf_config=None, to_hf=None,
    exports=lambda cfg: False, exports_doc="phi3: read only (qkv writes its shape as mistral or llama)"))
