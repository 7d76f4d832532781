"""The mixture-of-experts families (qkv.nn.moe) <-> qkv's decoder LM: LLaMA's attention with an MoE FFN.

    Mixtral    (modeling_mixtral.py)    block_sparse_moe.gate / .experts.{e}.w1 (gate), w3 (up), w2 (down);
                                        softmax over the top-k logits; a sliding_window slides every layer
    Qwen3-MoE  (modeling_qwen3_moe.py)  Qwen3's attention (q/k norm per head, head_dim apart); mlp.gate /
                                        mlp.experts.{e}.gate_proj, up_proj, down_proj, moe_intermediate_size
                                        wide; gates renormalised when norm_topk_prob; mlp_only_layers (and
                                        those off decoder_sparse_step) dense, intermediate_size wide
    OLMoE      (modeling_olmoe.py)      q/k RMS-normalised over all heads at once (model.qk_norm_whole);
                                        Qwen3-MoE's tensor names; gates not renormalised

Each expert is one GLU of the dense layer's names (ffn.experts.{e}.gate_proj, ...). Checkpoints keep each expert's
matrices apart (as transformers writes them); the stacked layout of transformers 5's modules
(mlp.experts.gate_up_proj (E, 2F, D), mlp.experts.down_proj (E, D, F)) is read too.
"""
from __future__ import annotations

import re
from dataclasses import replace

import torch

from qkv.config import ModelConfig
from qkv.formats.hf import llama
from qkv.formats.hf.common import (HF_FAMILIES, HfFamily, Rule, Tensors, ensure, import_tensors, rename)
from qkv.plan import layer_plans

MIXTRAL, QWEN3_MOE, OLMOE = "MixtralForCausalLM", "Qwen3MoeForCausalLM", "OlmoeForCausalLM"
EXPERT_NAMES = {"mixtral": {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}}  # else the dense names
ROUTER = {"mixtral": "block_sparse_moe"}  # the FFN's module name, else "mlp"


def count(hf: dict, *keys: str) -> int:
    """The first of `keys` config.json sets, as a non-negative integer (0 when none is set)."""
    for key in keys:
        value = hf.get(key)
        if value is not None:
            ensure(isinstance(value, int) and not isinstance(value, bool) and value >= 0,
                   f"{key}={value!r} must be a non-negative integer")
            return value
    return 0


def experts_of(hf: dict) -> dict:
    """The MoE fields every family shares: the expert count and k, checked against each other."""
    experts = count(hf, "num_local_experts", "num_experts")
    top_k = count(hf, "num_experts_per_tok")
    ensure(experts >= 1, "no num_local_experts / num_experts: an MoE model needs its expert count")
    ensure(1 <= top_k <= experts, f"num_experts_per_tok={top_k} must be in 1..{experts} (the expert count)")
    return {"moe_experts": experts, "moe_top_k": top_k}


def flag(hf: dict, key: str, default: bool) -> bool:
    value = hf.get(key, default)
    ensure(isinstance(value, bool), f"{key}={value!r} must be true or false")
    return value


def mixtral_config(hf: dict, architecture: str) -> ModelConfig:
    window = hf.get("sliding_window") or 0
    ensure(isinstance(window, int) and window >= 0, f"sliding_window={window!r} must be a positive integer or null")
    n_layers = count(hf, "num_hidden_layers")
    sliding = {"layer_types": ("sliding",) * n_layers, "sliding_window": window} if window else {}
    return llama.config(hf, architecture, **experts_of(hf), **sliding)


def qwen3_moe_config(hf: dict, architecture: str) -> ModelConfig:
    ensure(not hf.get("use_sliding_window", False), "use_sliding_window=true: Qwen3-MoE's sliding-window layers are "
                                                    "not supported by qkv")
    n_layers = count(hf, "num_hidden_layers")
    step = count(hf, "decoder_sparse_step") or 1
    only = hf.get("mlp_only_layers") or []
    ensure(isinstance(only, list) and all(isinstance(i, int) and 0 <= i < n_layers for i in only),
           f"mlp_only_layers must list layers of 0..{n_layers - 1}")
    dense = tuple(i for i in range(n_layers) if i in only or (i + 1) % step)
    moe_d_ff = count(hf, "moe_intermediate_size")
    ensure(moe_d_ff >= 1, "no moe_intermediate_size, which Qwen3-MoE's experts need")
    return llama.config(hf, architecture, qk_norm=True, **experts_of(hf), moe_d_ff=moe_d_ff,
                        moe_norm_topk=flag(hf, "norm_topk_prob", False), moe_dense_layers=dense)


def olmoe_config(hf: dict, architecture: str) -> ModelConfig:
    ensure(hf.get("clip_qkv") is None, f"clip_qkv={hf.get('clip_qkv')!r}: OLMoE's clipped q/k/v are not supported "
                                       "by qkv (only null)")
    return llama.config(hf, architecture, qk_norm=True, qk_norm_whole=True, **experts_of(hf),
                        moe_norm_topk=flag(hf, "norm_topk_prob", False))


def rules(cfg: ModelConfig, family: str) -> list[Rule]:
    """LLaMA's attention and norms, and each layer's FFN as the plan says: dense, or router and experts."""
    base = [rule for rule in llama.rules(replace(cfg, moe_experts=0))
            if not re.match(r"blocks\.\d+\.ffn\.", rule.qkv)]
    names, module = EXPERT_NAMES.get(family, {}), ROUTER.get(family, "mlp")
    out = []
    for i, plan in enumerate(layer_plans(cfg)):
        qkv, hf = f"blocks.{i}.ffn", f"model.layers.{i}.{module}"
        if not plan.moe:
            out += [Rule(f"{qkv}.{p}.weight", f"{hf}.{p}.weight") for p in ("gate_proj", "up_proj", "down_proj")]
            continue
        out.append(Rule(f"{qkv}.router.weight", f"{hf}.gate.weight"))
        out += [Rule(f"{qkv}.experts.{e}.{p}.weight", f"{hf}.experts.{e}.{names.get(p, p)}.weight")
                for e in range(cfg.moe_experts) for p in ("gate_proj", "up_proj", "down_proj")]
    return base + out


STACKED = {"gate_up_proj": ("gate_proj", "up_proj"), "gate_proj": ("gate_proj",), "up_proj": ("up_proj",),
           "down_proj": ("down_proj",)}  # a stacked tensor's kind -> the expert matrices it holds, in row order


def unstack(tensors: Tensors, family: str, experts: int | None = None) -> Tensors:
    """Stacked experts as each expert's own matrices under the family's names: transformers 5's modules
    (…experts.gate_up_proj (E, 2F, D), …experts.down_proj (E, D, F)) and GGUF's, renamed by
    qkv.formats.gguf (…experts.gate_proj.weight, up_proj, (E, F, D); down_proj (E, D, F)); others unchanged."""
    names = EXPERT_NAMES.get(family, {})
    out = {}
    for name, tensor in tensors.items():
        stacked = re.fullmatch(r"(.*\.experts)\.(gate_up_proj|down_proj)", name) or re.fullmatch(
            r"(.*\.experts)\.(gate_proj|up_proj|down_proj)\.weight", name)
        if stacked is None:
            out[name] = tensor
            continue
        prefix, kind = stacked.groups()
        parts = STACKED[kind]
        ensure(tensor.dim() == 3 and tensor.shape[1] % len(parts) == 0,
               f"{name} has shape {tuple(tensor.shape)}: stacked experts are (E, out, in)")
        ensure(experts is None or tensor.shape[0] == experts,
               f"{name} stacks {tensor.shape[0]} experts where the config says {experts}")
        for e in range(tensor.shape[0]):
            for part, rows in zip(parts, tensor[e].chunk(len(parts))):
                out[f"{prefix}.{e}.{names.get(part, part)}.weight"] = rows
    return out


def stack(tensors: Tensors) -> Tensors:
    """Each layer's experts as GGUF keeps them: …experts.{e}.<matrix>.weight (Mixtral's w1, w3, w2 or the dense
    names) stacked in expert order as …experts.gate_proj.weight, up_proj, down_proj (E, out, in)."""
    canonical = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
    groups: dict[tuple[str, str], dict[int, object]] = {}
    out = {}
    for name, tensor in tensors.items():
        expert = re.fullmatch(r"(.*\.experts)\.(\d+)\.(\w+)\.weight", name)
        if expert is None:
            out[name] = tensor
            continue
        prefix, e, matrix = expert.groups()
        groups.setdefault((prefix, canonical.get(matrix, matrix)), {})[int(e)] = tensor
    for (prefix, matrix), experts in groups.items():
        out[f"{prefix}.{matrix}.weight"] = torch.stack([experts[e] for e in range(len(experts))])
    return out


def reader(family: str):
    def to_qkv(tensors: Tensors, cfg: ModelConfig) -> Tensors:
        return import_tensors(unstack(tensors, family, cfg.moe_experts), rules(cfg, family), llama.ignored(cfg))
    return to_qkv


def writer(family: str):
    def to_hf(tensors: Tensors, cfg: ModelConfig) -> Tensors:
        return rename(tensors, rules(cfg, family), to_hf=True)
    return to_hf


def routed_plainly(cfg: ModelConfig, *, normalize: bool | None) -> bool:
    """Softmax scores, no scale, groups, bias or shared experts (Mixtral, Qwen3-MoE, OLMoE); the gates
    renormalised as `normalize` says (None: either)."""
    return (cfg.moe_experts > 0 and cfg.moe_scoring == "softmax" and cfg.moe_scale == 1.0 and cfg.moe_groups <= 1
            and not cfg.moe_choice_bias and not cfg.moe_shared_experts and not cfg.moe_capacity_factor
            and (normalize is None or cfg.moe_norm_topk == normalize) and cfg.ffn == "glu" and not cfg.bias)


def dense_twin(cfg: ModelConfig, **changes) -> ModelConfig:
    """The model with a dense FFN: what LLaMA's exporter checks of the rest."""
    return replace(cfg, moe_experts=0, moe_top_k=2, moe_norm_topk=True, moe_d_ff=0, moe_dense_layers=(), **changes)


def mixtral_exports(cfg: ModelConfig) -> bool:
    sliding = bool(cfg.layer_types) and set(cfg.layer_types) == {"sliding"} and not cfg.rope_local_theta
    rest = dense_twin(cfg, layer_types=(), sliding_window=0) if sliding else dense_twin(cfg)
    return (routed_plainly(cfg, normalize=True) and cfg.moe_d_ff in (0, cfg.d_ff) and not cfg.moe_dense_layers
            and llama.exports(rest))


def moe_keys(cfg: ModelConfig) -> dict:
    return {"num_experts_per_tok": cfg.moe_top_k, "router_aux_loss_coef": 0.001, "output_router_logits": False}


def mixtral_hf_config(cfg: ModelConfig) -> tuple[str, dict]:
    ensure(mixtral_exports(cfg), "not a Mixtral model")
    sliding = bool(cfg.layer_types)
    _, out = llama.hf_config(dense_twin(cfg, layer_types=(), sliding_window=0))
    return MIXTRAL, {**out, "model_type": "mixtral", "num_local_experts": cfg.moe_experts, **moe_keys(cfg),
                     "sliding_window": cfg.sliding_window if sliding else None, "router_jitter_noise": 0.0}


def qwen3_moe_exports(cfg: ModelConfig) -> bool:
    return (routed_plainly(cfg, normalize=None) and cfg.qk_norm and not cfg.qk_norm_whole
            and llama.exports(dense_twin(cfg, qk_norm=False)))


def qwen3_moe_hf_config(cfg: ModelConfig) -> tuple[str, dict]:
    ensure(qwen3_moe_exports(cfg), "not a Qwen3-MoE model")
    _, out = llama.hf_config(dense_twin(cfg, qk_norm=False))
    return QWEN3_MOE, {**out, "model_type": "qwen3_moe", "num_experts": cfg.moe_experts, **moe_keys(cfg),
                       "moe_intermediate_size": cfg.moe_d_ff or cfg.d_ff, "norm_topk_prob": cfg.moe_norm_topk,
                       "decoder_sparse_step": 1, "mlp_only_layers": sorted(cfg.moe_dense_layers),
                       "use_sliding_window": False, "sliding_window": None}


def olmoe_exports(cfg: ModelConfig) -> bool:
    return (routed_plainly(cfg, normalize=False) and cfg.qk_norm_whole and cfg.moe_d_ff in (0, cfg.d_ff)
            and not cfg.moe_dense_layers and llama.exports(dense_twin(cfg, qk_norm=False, qk_norm_whole=False)))


def olmoe_hf_config(cfg: ModelConfig) -> tuple[str, dict]:
    ensure(olmoe_exports(cfg), "not an OLMoE model")
    _, out = llama.hf_config(dense_twin(cfg, qk_norm=False, qk_norm_whole=False))
    return OLMOE, {**out, "model_type": "olmoe", "num_experts": cfg.moe_experts, **moe_keys(cfg),
                   "norm_topk_prob": False, "clip_qkv": None}


HF_FAMILIES.register("mixtral")(HfFamily(
    model_type="mixtral", architectures=(MIXTRAL,), config=mixtral_config, to_qkv=reader("mixtral"),
    hf_config=mixtral_hf_config, to_hf=writer("mixtral"), exports=mixtral_exports,
    exports_doc="mixtral: llama with experts (softmax over the top k)"))
HF_FAMILIES.register("qwen3_moe")(HfFamily(
    model_type="qwen3_moe", architectures=(QWEN3_MOE,), config=qwen3_moe_config, to_qkv=reader("qwen3_moe"),
    hf_config=qwen3_moe_hf_config, to_hf=writer("qwen3_moe"), exports=qwen3_moe_exports,
    exports_doc="qwen3_moe: qwen3 with experts, dense layers listed"))
HF_FAMILIES.register("olmoe")(HfFamily(
    model_type="olmoe", architectures=(OLMOE,), config=olmoe_config, to_qkv=reader("olmoe"),
    hf_config=olmoe_hf_config, to_hf=writer("olmoe"), exports=olmoe_exports,
    exports_doc="olmoe: llama with whole-width q/k norm and experts, gates not renormalised"))
