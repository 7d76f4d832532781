"""What every family mapping shares: the `HfFamily` record, renaming rules, HF config reading helpers.

A family maps one Hugging Face `model_type` to qkv and back with four pure functions:

    config(hf_config, architecture) -> ModelConfig          (QkvError for anything qkv cannot express)
    to_qkv(hf_tensors, cfg) -> qkv tensors                   (names and layouts of qkv's state_dict)
    hf_config(cfg) -> (architecture, hf_config)              (QkvError when cfg has no HF equivalent)
    to_hf(qkv_tensors, cfg) -> hf tensors

Most tensors are a pure rename, some a transpose (GPT-2's Conv1D stores (in, out)); the few that are
split, concatenated or padded are done by the family itself around `rename`.
"""
from __future__ import annotations

import json
import math

from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import Tensor

from qkv.config import ModelConfig
from qkv.errors import QkvError
from qkv.registry import Registry

Tensors = dict[str, Tensor]


@dataclass(frozen=True)
class Rule:
    """qkv tensor `qkv` is HF tensor `hf` (transposed when `transpose`)."""

    qkv: str
    hf: str
    transpose: bool = False


@dataclass(frozen=True)
class HfFamily:
    model_type: str  # HF config.json "model_type"
    architectures: tuple[str, ...]  # HF classes this family reads and writes
    config: Callable[[dict, str], ModelConfig]
    to_qkv: Callable[[Tensors, ModelConfig], Tensors]
    hf_config: Callable[[ModelConfig], tuple[str, dict]] | None  # None: read only (`exports` is never True)
    to_hf: Callable[[Tensors, ModelConfig], Tensors] | None
    exports: Callable[[ModelConfig], bool]  # save picks the family whose `exports` is True
    exports_doc: str  # the qkv models it writes, for the error that lists the families


HF_FAMILIES: Registry[HfFamily] = Registry("Hugging Face model_type")

# HF activation names (transformers.activations.ACT2FN) <-> qkv's registry names; only exact matches
ACTIVATIONS_FROM_HF = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh",
                       "relu": "relu", "silu": "silu", "swish": "silu"}
ACTIVATIONS_TO_HF = {"gelu": "gelu", "gelu_tanh": "gelu_new", "relu": "relu", "silu": "silu"}


def activation_from_hf(name: str, key: str) -> str:
    if name not in ACTIVATIONS_FROM_HF:
        raise QkvError(f"{key}={name!r} has no qkv activation; "
                       f"supported: {', '.join(sorted(ACTIVATIONS_FROM_HF))}")
    return ACTIVATIONS_FROM_HF[name]


def activation_to_hf(cfg: ModelConfig) -> str:
    if cfg.activation not in ACTIVATIONS_TO_HF:
        raise QkvError(f"model.activation={cfg.activation!r} has no Hugging Face equivalent; "
                       f"exportable: {', '.join(sorted(ACTIVATIONS_TO_HF))}")
    return ACTIVATIONS_TO_HF[cfg.activation]


def need(hf: dict, key: str) -> Any:
    if hf.get(key) is None:  # absent, or null
        raise QkvError(f"no {key!r}, which this architecture needs")
    return hf[key]


def refuse(hf: dict, key: str, allowed: Any, what: str) -> None:
    """Raise unless hf[key] (absent = `allowed`) equals `allowed`: a feature qkv does not implement."""
    value = hf.get(key, allowed)
    if value != allowed and value is not None:
        raise QkvError(f"{key}={value!r}: {what} is not supported by qkv (only {allowed!r})")


def ensure(condition: bool, message: str) -> None:
    if not condition:
        raise QkvError(message)


def rename(tensors: Tensors, rules: list[Rule], *, to_hf: bool) -> Tensors:
    """Apply `rules` in one direction; a missing source tensor is an error naming it."""
    out = {}
    for rule in rules:
        src, dst = (rule.qkv, rule.hf) if to_hf else (rule.hf, rule.qkv)
        if src not in tensors:
            raise QkvError(f"checkpoint has no tensor {src!r}; it does not match config.json")
        tensor = tensors[src]
        out[dst] = tensor.t().contiguous() if rule.transpose else tensor
    return out


def import_tensors(tensors: Tensors, rules: list[Rule], ignored: Callable[[str], bool]) -> Tensors:
    """HF -> qkv by `rules`; an HF tensor neither used nor `ignored` is an error (a feature qkv would drop)."""
    used = {rule.hf for rule in rules}
    extra = sorted(name for name in tensors if name not in used and not ignored(name))
    if extra:
        more = f" and {len(extra) - 3} more" if len(extra) > 3 else ""
        raise QkvError(f"checkpoint tensors qkv cannot map: {', '.join(extra[:3])}{more}")
    return rename(tensors, rules, to_hf=False)


def strip_prefix(tensors: Tensors, prefix: str, probe: str) -> Tensors:
    """Drop `prefix` from every name when the checkpoint has it (`probe` tells: e.g. a base model saved
    alone has no "bert." / "transformer." in front)."""
    if prefix + probe not in tensors:
        return tensors
    return {name.removeprefix(prefix): t for name, t in tensors.items()}


def block_rules(n_layers: int, qkv_prefix: str, hf_prefix: str, pairs: list[tuple[str, str]],
                transpose: tuple[str, ...] = ()) -> list[Rule]:
    """Per-layer rules: `{qkv_prefix}{i}.{a}` <-> `{hf_prefix}{i}.{b}` for (a, b) in pairs."""
    return [Rule(f"{qkv_prefix}{i}.{a}", f"{hf_prefix}{i}.{b}", a in transpose)
            for i in range(n_layers) for a, b in pairs]


def linear(qkv: str, hf: str, bias: bool) -> list[tuple[str, str]]:
    """The weight (and bias) pairs of one linear layer or norm."""
    return [(f"{qkv}.weight", f"{hf}.weight")] + ([(f"{qkv}.bias", f"{hf}.bias")] if bias else [])


def plain(cfg: ModelConfig) -> bool:
    """None of the per-layer plan's or the newer families' choices (qkv.plan): every layer global and
    alike, Dh = D / H, no q/k norm, no soft caps or own score scale, unscaled RoPE, no bigram table. What the
    families of 2019-23 (GPT-2, BERT, BART, T5, LLaMA 2) can say."""
    return (not cfg.layer_types and not cfg.head_size and not cfg.qk_norm and not cfg.attn_softcap
            and not cfg.logit_softcap and not cfg.query_scale and cfg.rope_scaling == "none" and not cfg.bigram_vocab)


def is_zero(tensor: Tensor | None) -> bool:
    return tensor is None or not bool(torch.any(tensor != 0))


# The config.json keys qkv reads, by the JSON type each must have (null: absent). Checked before any is used.
INTEGER_KEYS = ("vocab_size", "n_positions", "n_embd", "n_layer", "n_head", "n_inner", "hidden_size",
                "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                "max_position_embeddings", "d_model", "d_ff", "d_kv", "num_layers", "num_decoder_layers",
                "num_heads", "decoder_layers", "encoder_layers", "encoder_attention_heads", "encoder_ffn_dim",
                "decoder_attention_heads", "decoder_ffn_dim", "relative_attention_num_buckets",
                "relative_attention_max_distance", "type_vocab_size", "num_labels", "head_dim")
NUMBER_KEYS = ("layer_norm_epsilon", "layer_norm_eps", "rms_norm_eps", "rope_theta")
BOOL_KEYS = ("tie_word_embeddings", "attention_bias", "mlp_bias", "scale_embedding", "scale_decoder_outputs")
STRING_KEYS = ("model_type", "activation_function", "hidden_act", "feed_forward_proj")
MAX_SIZE = 2 ** 31


def check_types(hf: dict) -> None:
    """Every key qkv reads has its JSON type and a sane range; QkvError naming the first that does not."""
    def wrong(key: str, what: str) -> QkvError:
        return QkvError(f"{key}={json.dumps(hf[key])[:40]} must be {what}")

    for key in INTEGER_KEYS:
        value = hf.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_SIZE):
            raise wrong(key, f"an integer in [0, {MAX_SIZE}]")
    for key in NUMBER_KEYS:
        value = hf.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                  or not math.isfinite(value) or value < 0):
            raise wrong(key, "a finite number >= 0")
    for key, kind, what in [(k, bool, "true or false") for k in BOOL_KEYS] + [(k, str, "a string") for k in STRING_KEYS]:
        if hf.get(key) is not None and not isinstance(hf[key], kind):
            raise wrong(key, what)
    arch = hf.get("architectures")
    if arch is not None and (not isinstance(arch, list) or not all(isinstance(a, str) for a in arch)):
        raise wrong("architectures", "a list of class names")
    eos = hf.get("eos_token_id")
    if eos is not None and not (isinstance(eos, int) and not isinstance(eos, bool) or
                                isinstance(eos, list) and all(isinstance(i, int) for i in eos)):
        raise wrong("eos_token_id", "a token id or a list of them")
