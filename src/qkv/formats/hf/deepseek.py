"""DeepSeek-V2 (V2, V2-Lite) and DeepSeek-V3 (transformers' modeling_deepseek_v2.py / _v3.py) <-> qkv's decoder LM
with multi-head latent attention (qkv.nn.mla) and a mixture of experts (qkv.nn.moe).

    self_attn.q_a_proj, q_a_layernorm, q_b_proj   -> attn.q_a_proj, q_a_norm, q_b_proj  (q_lora_rank; V2-Lite:
                                                    none, self_attn.q_proj -> attn.q_proj)
    self_attn.kv_a_proj_with_mqa, kv_a_layernorm  -> attn.kv_a_proj, kv_a_norm           (the latent and k^R)
    self_attn.kv_b_proj, o_proj                    -> attn.kv_b_proj, o_proj
    mlp (layers < first_k_dense_replace)           -> a dense GLU, intermediate_size wide
    mlp.gate, gate.e_score_correction_bias (V3)    -> ffn.router, ffn.router_bias
    mlp.experts.{e}, mlp.shared_experts            -> ffn.experts.{e}, ffn.shared (moe_intermediate_size wide;
                                                    n_shared_experts of them as one FFN)

RoPE: DeepSeek turns the rope dims in interleaved pairs (x0, x1), (x2, x3), ... (V2 as complex numbers, V3 with
rope_interleave); qkv's RoPE pairs i with i + d_R / 2. The same permutation of the rotated rows of both q and k
(evens first, then odds) makes one the other: their dot products are unchanged, so the rows are permuted on
reading and back on writing. Routing: V2 softmax, greedy or group_limited_greedy (groups ranked by their best
score), not renormalised, routed_scaling_factor; V3 sigmoid scores, a choosing bias, groups ranked by their two
best, renormalised (norm_topk_prob), scaled. YaRN's mscale_all_dim multiplies the scores' scale by mscale^2
(model.query_scale). The released V3 checkpoint's multi-token-prediction layer (model.layers.61, num_mtp_layers)
is not part of the language model and is left unread. Written back as the version whose routing the model has
(V3: sigmoid with a choosing bias; V2: softmax, unnormalised), the rows interleaved again.
"""
from __future__ import annotations

import math
import re

import torch

from qkv.config import ModelConfig
from qkv.formats.hf.common import (HF_FAMILIES, HfFamily, Rule, Tensors, activation_from_hf, activation_to_hf, ensure,
                                   import_tensors, need, rename)
from qkv.formats.hf.moe import count, flag, unstack
from qkv.formats.hf.rope import rope_fields
from qkv.plan import layer_plans

V2, V3 = "DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM"


def config(hf: dict, architecture: str) -> ModelConfig:
    v3 = architecture == V3
    d_model, n_heads = need(hf, "hidden_size"), need(hf, "num_attention_heads")
    nope, rope, v_dim = (count(hf, key) for key in ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"))
    ensure(nope >= 1 and rope >= 2 and v_dim >= 1, "qk_nope_head_dim, qk_rope_head_dim and v_head_dim must be set")
    # (num_key_value_heads says nothing here: every head has its own keys, made from the one latent)
    experts = count(hf, "n_routed_experts")
    n_layers = need(hf, "num_hidden_layers")
    dense = count(hf, "first_k_dense_replace")
    routing = v3_routing(hf) if v3 else v2_routing(hf)
    params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    fields = rope_fields({**hf, "rope_parameters": {k: v for k, v in params.items() if k not in ("mscale", "mscale_all_dim")}})
    if fields.get("rope_scaling") == "yarn":  # cos and sin times mscale(s, mscale) / mscale(s, mscale_all_dim)
        fields["rope_yarn_mscale"] = yarn_mscale(params.get("factor", 1.0), params.get("mscale", 1.0)) / yarn_mscale(
            params.get("factor", 1.0), params.get("mscale_all_dim", 0.0))
    head_dim = nope + rope
    ensure(experts >= 1, "n_routed_experts is missing or 0: a DeepSeek model's MoE layers need experts")
    return ModelConfig(
        arch="decoder", vocab_size=need(hf, "vocab_size"), d_model=d_model, n_heads=n_heads, head_size=head_dim,
        n_layers=n_layers, d_ff=need(hf, "intermediate_size"), max_seq_len=hf.get("max_position_embeddings", 4096),
        positional="rope", norm="rmsnorm", norm_eps=hf.get("rms_norm_eps", 1e-6), norm_placement="pre", ffn="glu",
        activation=activation_from_hf(hf.get("hidden_act", "silu"), "hidden_act"), bias=False, dropout=0.0,
        tie_embeddings=hf.get("tie_word_embeddings", False), mla_kv_rank=need(hf, "kv_lora_rank"),
        mla_q_rank=hf.get("q_lora_rank") or 0, mla_rope_dims=rope, mla_v_dims=v_dim,
        query_scale=head_dim / mscale(hf) ** 4 if mscale(hf) != 1.0 else 0.0,
        moe_experts=experts, moe_top_k=need(hf, "num_experts_per_tok"), moe_d_ff=need(hf, "moe_intermediate_size"),
        moe_shared_experts=count(hf, "n_shared_experts"), moe_dense_layers=tuple(range(min(dense, n_layers))),
        **routing, **fields)


def v2_routing(hf: dict) -> dict:
    method = hf.get("topk_method", "greedy")
    ensure(method in ("greedy", "group_limited_greedy"), f"topk_method={method!r}: DeepSeek-V2 routes greedy or "
                                                         "group_limited_greedy")
    groups = {"moe_groups": count(hf, "n_group"), "moe_group_top_k": count(hf, "topk_group")} if (
        method == "group_limited_greedy") else {}
    return {"moe_scoring": "softmax", "moe_norm_topk": False, "moe_scale": float(hf.get("routed_scaling_factor", 1.0)),
            **groups}


def v3_routing(hf: dict) -> dict:
    groups = count(hf, "n_group") or 1
    return {"moe_scoring": "sigmoid", "moe_choice_bias": True, "moe_norm_topk": flag(hf, "norm_topk_prob", True),
            "moe_scale": float(hf.get("routed_scaling_factor", 1.0)),
            **({"moe_groups": groups, "moe_group_top_k": count(hf, "topk_group")} if groups > 1 else {})}


def yarn_mscale(factor: float, m: float) -> float:
    """YaRN's 0.1 m ln(factor) + 1 (1 for factor <= 1 or m = 0)."""
    return 0.1 * m * math.log(factor) + 1.0 if factor > 1 and m else 1.0


def mscale(hf: dict) -> float:
    """YaRN's 0.1 mscale_all_dim ln(factor) + 1, by which DeepSeek scales the scores twice (1 without YaRN)."""
    params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    if params.get("rope_type", params.get("type", "default")) == "default":
        return 1.0
    return yarn_mscale(params.get("factor", 1.0), params.get("mscale_all_dim", 0))


def rules(cfg: ModelConfig) -> list[Rule]:
    out = [Rule("tok_emb.weight", "model.embed_tokens.weight"), Rule("final_norm.weight", "model.norm.weight")]
    out += [] if cfg.tie_embeddings else [Rule("lm_head.weight", "lm_head.weight")]
    attn = (["q_a_proj", ("q_a_norm", "q_a_layernorm"), "q_b_proj"] if cfg.mla_q_rank else ["q_proj"]) + [
        ("kv_a_proj", "kv_a_proj_with_mqa"), ("kv_a_norm", "kv_a_layernorm"), "kv_b_proj", "o_proj"]
    for i, plan in enumerate(layer_plans(cfg)):
        q, h = f"blocks.{i}.", f"model.layers.{i}."
        out += [Rule(f"{q}attn_norm.weight", f"{h}input_layernorm.weight"),
                Rule(f"{q}ffn_norm.weight", f"{h}post_attention_layernorm.weight")]
        out += [Rule(f"{q}attn.{a if isinstance(a, str) else a[0]}.weight",
                     f"{h}self_attn.{a if isinstance(a, str) else a[1]}.weight") for a in attn]
        glu = ("gate_proj", "up_proj", "down_proj")
        if not plan.moe:
            out += [Rule(f"{q}ffn.{p}.weight", f"{h}mlp.{p}.weight") for p in glu]
            continue
        out.append(Rule(f"{q}ffn.router.weight", f"{h}mlp.gate.weight"))
        if cfg.moe_choice_bias:
            out.append(Rule(f"{q}ffn.router_bias", f"{h}mlp.gate.e_score_correction_bias"))
        out += [Rule(f"{q}ffn.experts.{e}.{p}.weight", f"{h}mlp.experts.{e}.{p}.weight")
                for e in range(cfg.moe_experts) for p in glu]
        if cfg.moe_shared_experts:
            out += [Rule(f"{q}ffn.shared.{p}.weight", f"{h}mlp.shared_experts.{p}.weight") for p in glu]
    return out


def deinterleave(rope: int) -> torch.Tensor:
    """The order that takes interleaved pairs (0, 1), (2, 3), ... to rotate-half's halves: evens, then odds."""
    return torch.cat((torch.arange(0, rope, 2), torch.arange(1, rope, 2)))


def rope_rows(name: str, tensor: torch.Tensor, cfg: ModelConfig, inverse: bool) -> torch.Tensor:
    """q's and k^R's rotated rows de-interleaved (or, `inverse`, interleaved again); other tensors unchanged."""
    order = deinterleave(cfg.mla_rope_dims)
    if inverse:
        order = torch.argsort(order)
    if re.search(r"\.(q_b_proj|q_proj)\.weight$", name):
        rows = tensor.view(cfg.n_heads, cfg.head_dim, -1)
        nope = cfg.head_dim - cfg.mla_rope_dims
        return torch.cat((rows[:, :nope], rows[:, nope:][:, order]), dim=1).reshape(tensor.shape)
    if re.search(r"\.kv_a_proj(_with_mqa)?\.weight$", name):
        return torch.cat((tensor[:cfg.mla_kv_rank], tensor[cfg.mla_kv_rank:][order]))
    return tensor


def interleaved(hf: dict, architecture: str) -> bool:
    return architecture == V2 or flag(hf, "rope_interleave", True)


def ignored(cfg: ModelConfig):
    def check(name: str) -> bool:  # the multi-token-prediction layers past the last; RoPE tables; a tied head
        layer = re.match(r"model\.layers\.(\d+)\.", name)
        return bool(layer and int(layer.group(1)) >= cfg.n_layers) or name.endswith("rotary_emb.inv_freq") or (
            cfg.tie_embeddings and name == "lm_head.weight")
    return check


def joined(tensors: Tensors, cfg: ModelConfig) -> Tensors:
    """kv_b_proj from llama.cpp's split of it (qkv.formats.gguf.deepseek): k_b_proj (H, r, d_N), each head's W_UK
    transposed, and v_b_proj (H, d_V, r), one head's rows after the other's as the checkpoint keeps them."""
    out = dict(tensors)
    for name in [n for n in tensors if n.endswith("self_attn.k_b_proj.weight")]:
        v_name = name.replace("k_b_proj", "v_b_proj")
        ensure(v_name in tensors, f"{name} comes with {v_name}")
        k_b, v_b = out.pop(name), out.pop(v_name)
        ensure(k_b.dim() == 3 and v_b.dim() == 3 and k_b.shape[0] == v_b.shape[0] == cfg.n_heads,
               f"{name} {tuple(k_b.shape)} and {v_name} {tuple(v_b.shape)} must be (heads, ., .) with "
               f"{cfg.n_heads} heads")
        out[name.replace("k_b_proj", "kv_b_proj")] = torch.cat((k_b.transpose(1, 2), v_b), dim=1).reshape(
            -1, k_b.shape[1])
    return out


def to_qkv(tensors: Tensors, cfg: ModelConfig) -> Tensors:
    tensors = unstack(joined(tensors, cfg), "deepseek", cfg.moe_experts)  # (GGUF's forms: qkv.formats.gguf.deepseek)
    out = import_tensors(tensors, rules(cfg), ignored(cfg))
    return {name: rope_rows(name, t, cfg, inverse=False) for name, t in out.items()}


def to_hf(tensors: Tensors, cfg: ModelConfig) -> Tensors:
    out = rename(tensors, rules(cfg), to_hf=True)
    return {name: rope_rows(name, t, cfg, inverse=True) for name, t in out.items()}


def version(cfg: ModelConfig) -> str | None:
    """V3 or V2 where `cfg` is one of them (each's routing; latent attention; dense layers first), else None."""
    dense = cfg.moe_dense_layers == tuple(range(len(cfg.moe_dense_layers)))
    yarn_scale = mscale_of(cfg)
    shaped = (cfg.arch == "decoder" and cfg.mla_kv_rank and cfg.moe_experts and dense and cfg.positional == "rope"
              and cfg.norm == "rmsnorm" and cfg.norm_placement == "pre" and cfg.ffn == "glu" and not cfg.bias
              and not cfg.layer_types and not cfg.qk_norm and not cfg.logit_softcap and not cfg.bigram_vocab
              and not cfg.embed_scale and not cfg.moe_capacity_factor and cfg.rope_scaling in ("none", "yarn")
              and yarn_scale is not None)
    if not shaped:
        return None
    if cfg.moe_scoring == "sigmoid" and cfg.moe_choice_bias:
        return "v3"
    if cfg.moe_scoring == "softmax" and not cfg.moe_choice_bias and not cfg.moe_norm_topk:
        return "v2"
    return None


def mscale_of(cfg: ModelConfig) -> float | None:
    """mscale_all_dim from the scores' scale (query_scale = Dh / mscale^4 under YaRN, unset without); None where
    the scale says something else."""
    if cfg.rope_scaling == "none":
        return 0.0 if not cfg.query_scale else None
    if cfg.rope_yarn_mscale not in (0.0, 1.0):
        return None
    mscale = (cfg.head_dim / cfg.query_scale) ** 0.25 if cfg.query_scale else 1.0
    return (mscale - 1.0) / (0.1 * math.log(cfg.rope_factor)) if cfg.rope_factor > 1 else (0.0 if mscale == 1.0 else None)


def hf_config(cfg: ModelConfig) -> tuple[str, dict]:
    which = version(cfg)
    ensure(which is not None, "not a DeepSeek-V2 or -V3 model")
    rope = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if cfg.rope_scaling == "yarn":
        all_dim = mscale_of(cfg)
        rope = {"rope_type": "yarn", "rope_theta": cfg.rope_theta, "factor": cfg.rope_factor,
                "original_max_position_embeddings": cfg.rope_original_context, "beta_fast": cfg.rope_beta_fast,
                "beta_slow": cfg.rope_beta_slow, "mscale": all_dim, "mscale_all_dim": all_dim}
    groups = {"n_group": cfg.moe_groups or 1, "topk_group": cfg.moe_group_top_k or 1}
    out = {"model_type": f"deepseek_{which}", "vocab_size": cfg.vocab_size, "hidden_size": cfg.d_model,
           "intermediate_size": cfg.d_ff, "moe_intermediate_size": cfg.moe_d_ff or cfg.d_ff,
           "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads,
           "num_key_value_heads": cfg.n_heads, "n_shared_experts": cfg.moe_shared_experts,
           "n_routed_experts": cfg.moe_experts, "num_experts_per_tok": cfg.moe_top_k,
           "routed_scaling_factor": cfg.moe_scale, "kv_lora_rank": cfg.mla_kv_rank, "q_lora_rank": cfg.mla_q_rank or None,
           "qk_rope_head_dim": cfg.mla_rope_dims, "qk_nope_head_dim": cfg.head_dim - cfg.mla_rope_dims,
           "v_head_dim": cfg.mla_v_dims or cfg.head_dim, "first_k_dense_replace": len(cfg.moe_dense_layers),
           "hidden_act": activation_to_hf(cfg), "max_position_embeddings": cfg.max_seq_len,
           "rms_norm_eps": cfg.norm_eps, "tie_word_embeddings": cfg.tie_embeddings, "attention_bias": False,
           "rope_parameters": rope, "rope_interleave": True}
    if which == "v3":
        out.update(norm_topk_prob=cfg.moe_norm_topk, **groups)
    else:
        out.update(topk_method="group_limited_greedy" if cfg.moe_groups > 1 else "greedy",
                   **(groups if cfg.moe_groups > 1 else {}))
    return (V3 if which == "v3" else V2), out


def reader(architecture: str):
    def read(hf: dict, arch: str) -> ModelConfig:
        ensure(interleaved(hf, arch), "rope_interleave=false: qkv reads DeepSeek's interleaved RoPE layout only")
        return config(hf, arch)
    return read


HF_FAMILIES.register("deepseek_v2")(HfFamily(
    model_type="deepseek_v2", architectures=(V2,), config=reader(V2), to_qkv=to_qkv, hf_config=hf_config, to_hf=to_hf,
    exports=lambda cfg: version(cfg) == "v2", exports_doc="deepseek_v2: latent attention, softmax experts"))
HF_FAMILIES.register("deepseek_v3")(HfFamily(
    model_type="deepseek_v3", architectures=(V3,), config=reader(V3), to_qkv=to_qkv, hf_config=hf_config, to_hf=to_hf,
    exports=lambda cfg: version(cfg) == "v3", exports_doc="deepseek_v3: latent attention, sigmoid experts"))
