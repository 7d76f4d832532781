"""RoPE's settings in config.json <-> model.rope_* (qkv.rope_scaling).

transformers 5 keeps them in `rope_parameters` ({"rope_type", "rope_theta", "factor", ...}; Gemma 3 one such
object per layer type), 4.x in `rope_theta` and `rope_scaling` ({"rope_type" or "type", "factor", ...}).
"""
from __future__ import annotations

from typing import Any

from qkv.config import ModelConfig
from qkv.errors import QkvError

KINDS = {"default": "none", "linear": "linear", "llama3": "llama3", "yarn": "yarn"}  # HF rope_type -> qkv


def parameters(hf: dict, layer_type: str | None = None) -> dict:
    """The RoPE object of config.json (of `layer_type` where it has one per layer type)."""
    params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    if not isinstance(params, dict):
        raise QkvError(f"rope_parameters / rope_scaling={params!r} must be an object")
    if layer_type is not None and isinstance(params.get(layer_type), dict):
        return params[layer_type]
    return params


def number(params: dict, key: str, default: Any) -> float:
    value = params.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise QkvError(f"rope {key}={value!r} must be a positive number")
    return value


def rope_fields(hf: dict, layer_type: str | None = None) -> dict:
    """ModelConfig's rope_* fields from config.json."""
    params = parameters(hf, layer_type)
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in KINDS:
        raise QkvError(f"rope_type={kind!r}: this RoPE scaling is not supported by qkv; supported: {', '.join(KINDS)}")
    fields: dict[str, Any] = {"rope_theta": float(number(params, "rope_theta", hf.get("rope_theta", 10000.0))),
                              "rope_scaling": KINDS[kind]}
    if kind == "default":
        return fields
    fields["rope_factor"] = float(number(params, "factor", None))
    if kind == "llama3":
        fields.update(rope_original_context=int(number(params, "original_max_position_embeddings", None)),
                      rope_low_freq_factor=float(number(params, "low_freq_factor", 1.0)),
                      rope_high_freq_factor=float(number(params, "high_freq_factor", 4.0)))
    if kind == "yarn":
        for key in ("attention_factor", "mscale", "mscale_all_dim"):
            if params.get(key) not in (None, 0, 1, 1.0) and not (key == "mscale_all_dim" and params.get(key) == 0):
                raise QkvError(f"rope {key}={params[key]!r}: YaRN with its own attention factor is not supported "
                               "by qkv (only 0.1 ln s + 1)")
        truncate = params.get("truncate", True)
        if not isinstance(truncate, bool):
            raise QkvError(f"rope truncate={truncate!r} must be true or false")
        fields["rope_yarn_truncate"] = truncate
        fields.update(rope_original_context=int(number(params, "original_max_position_embeddings",
                                                       hf.get("max_position_embeddings"))),
                      rope_beta_fast=float(number(params, "beta_fast", 32.0)),
                      rope_beta_slow=float(number(params, "beta_slow", 1.0)))
    return fields


def rope_parameters(cfg: ModelConfig) -> dict:
    """config.json's RoPE object of qkv's global layers."""
    kind = {v: k for k, v in KINDS.items()}[cfg.rope_scaling]
    params: dict[str, Any] = {"rope_type": kind, "rope_theta": cfg.rope_theta}
    if kind != "default":
        params["factor"] = cfg.rope_factor
    if kind == "llama3":
        params.update(original_max_position_embeddings=cfg.rope_original_context,
                      low_freq_factor=cfg.rope_low_freq_factor, high_freq_factor=cfg.rope_high_freq_factor)
    if kind == "yarn":
        params.update(original_max_position_embeddings=cfg.rope_original_context, beta_fast=cfg.rope_beta_fast,
                      beta_slow=cfg.rope_beta_slow, **({} if cfg.rope_yarn_truncate else {"truncate": False}))
    return params


def partial_rows(w, heads: int, head_dim: int, rotated: int):
    """Q's or K's rows (heads Dh, ...) from HF's partial rotation to qkv's layout (model.rope_dims). HF turns the
    pairs (i, i + r/2) of each head's first r dimensions and passes the rest through; qkv turns the pairs
    (j, j + Dh/2), the first r/2 of them, and leaves the others at frequency 0. So each head's dimensions go out
    in the order [first half of the turned | first half of the passed | second half of the turned | second half
    of the passed]: the turned pairs meet as qkv pairs them, and q . k, permuted alike in q and k, is unchanged
    (as the rotate-half layout itself, docs/DEVIATIONS.md)."""
    import torch

    if rotated in (0, head_dim):
        return w
    half, rest = rotated // 2, (head_dim - rotated) // 2
    order = torch.cat([torch.arange(half), rotated + torch.arange(rest), half + torch.arange(half),
                       rotated + rest + torch.arange(head_dim - rotated - rest)])
    return w.reshape(heads, head_dim, *w.shape[1:])[:, order].reshape(w.shape)
