"""gpt-oss (OpenAI 2025; transformers' modeling_gpt_oss.py) <-> qkv's decoder LM: attention with biases and a sink
logit per head (model.attn_sinks), sliding (128 keys) and global layers alternating (the plan's layer_types), YaRN
RoPE with its ramp unrounded (truncate: false), and an MoE of clamped SwiGLU experts (ffn="glu_clamped") behind
a router with a bias, the gates a softmax over the top k logits.

The experts are stored stacked and transposed, gate and up interleaved in columns: mlp.experts.gate_up_proj
(E, D, 2F) with gate = [..., 0::2], up = [..., 1::2], its bias gate_up_proj_bias (E, 2F) alike; down_proj (E, F, D)
and down_proj_bias (E, D). Each expert becomes qkv's GLU of the dense names (ffn.experts.{e}.gate_proj, ...) and
back. The released checkpoints keep the experts in MXFP4 (…_blocks, …_scales: `mxfp4` dequantizes them to float32
on reading; GGUF files' MXFP4 the `gguf` package dequantizes).
"""
from __future__ import annotations

import torch

from qkv.config import ModelConfig
from qkv.formats.hf.common import HF_FAMILIES, HfFamily, Rule, Tensors, ensure, import_tensors, linear, need, rename
from qkv.formats.hf.moe import count
from qkv.formats.hf.rope import rope_fields, rope_parameters
from qkv.nn.ffn import CLAMP_ALPHA, CLAMP_LIMIT

ARCHITECTURE = "GptOssForCausalLM"
KINDS = {"sliding_attention": "sliding", "full_attention": "global"}


def config(hf: dict, architecture: str) -> ModelConfig:
    ensure(float(hf.get("swiglu_limit", CLAMP_LIMIT)) == CLAMP_LIMIT and
           float(hf.get("swiglu_alpha", CLAMP_ALPHA)) == CLAMP_ALPHA,
           f"swiglu_limit={hf.get('swiglu_limit')!r}, swiglu_alpha={hf.get('swiglu_alpha')!r}: qkv's clamped SwiGLU "
           f"is gpt-oss's ({CLAMP_LIMIT}, {CLAMP_ALPHA})")
    quant = hf.get("quantization_config") or {}
    ensure(not quant or isinstance(quant, dict) and quant.get("quant_method") == "mxfp4",
           f"quantization_config={quant!r}: qkv reads gpt-oss's experts in float or MXFP4 (quant_method mxfp4)")
    d_model, n_heads = need(hf, "hidden_size"), need(hf, "num_attention_heads")
    head_dim = hf.get("head_dim") or d_model // n_heads
    n_layers = need(hf, "num_hidden_layers")
    kinds = hf.get("layer_types") or ["full_attention"] * n_layers
    ensure(isinstance(kinds, list) and len(kinds) == n_layers and all(k in KINDS for k in kinds),
           f"layer_types must give one of {', '.join(KINDS)} for each of the {n_layers} layers")
    layer_types = tuple(KINDS[k] for k in kinds)
    sliding = "sliding" in layer_types
    experts, top_k = count(hf, "num_local_experts"), count(hf, "num_experts_per_tok", "experts_per_token")
    ensure(experts >= 1 and 1 <= top_k <= experts, f"num_experts_per_tok={top_k} must be in 1..{experts} (the "
                                                    "expert count)")
    return ModelConfig(
        arch="decoder", vocab_size=need(hf, "vocab_size"), d_model=d_model, n_heads=n_heads,
        head_size=head_dim if head_dim * n_heads != d_model else 0, n_kv_heads=hf.get("num_key_value_heads") or n_heads,
        n_layers=n_layers, d_ff=need(hf, "intermediate_size"), max_seq_len=hf.get("max_position_embeddings", 4096),
        positional="rope", norm="rmsnorm", norm_eps=hf.get("rms_norm_eps", 1e-5), norm_placement="pre",
        ffn="glu_clamped", activation="silu", bias=bool(hf.get("attention_bias", True)), dropout=0.0,
        tie_embeddings=hf.get("tie_word_embeddings", False), attn_sinks=True,
        layer_types=layer_types if sliding else (), sliding_window=need(hf, "sliding_window") if sliding else 0,
        moe_experts=experts, moe_top_k=top_k, moe_router_bias=True, **rope_fields(hf))


def rules(cfg: ModelConfig) -> list[Rule]:
    out = [Rule("tok_emb.weight", "model.embed_tokens.weight"), Rule("final_norm.weight", "model.norm.weight")]
    out += [] if cfg.tie_embeddings else [Rule("lm_head.weight", "lm_head.weight")]
    for i in range(cfg.n_layers):
        q, h = f"blocks.{i}.", f"model.layers.{i}."
        pairs = (linear("attn_norm", "input_layernorm", False) + linear("ffn_norm", "post_attention_layernorm", False)
                 + [pair for name in "qkvo" for pair in linear(f"attn.{name}_proj", f"self_attn.{name}_proj", cfg.bias)]
                 + [("attn.sinks", "self_attn.sinks")] + linear("ffn.router", "mlp.router", True)
                 + [(f"ffn.experts.{e}.{p}.{kind}", f"mlp.experts.{e}.{p}.{kind}") for e in range(cfg.moe_experts)
                    for p in ("gate_proj", "up_proj", "down_proj") for kind in ("weight", "bias")])
        out += [Rule(q + a, h + b) for a, b in pairs]
    return out


def unstacked(tensors: Tensors, cfg: ModelConfig) -> Tensors:
    """The stacked, transposed, interleaved experts as each expert's GLU matrices (out, in) and biases."""
    out = dict(tensors)
    for i in range(cfg.n_layers):
        prefix = f"model.layers.{i}.mlp.experts."
        if prefix + "gate_proj.weight" in out:  # GGUF's layout (qkv.formats.gguf.gpt_oss): gate and up apart
            out.update(split_stacks(out, prefix, cfg))
            continue
        names = [prefix + n for n in ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")]
        missing = [n for n in names if n not in out]
        ensure(not missing, f"checkpoint has no tensor {missing[0]!r}" if missing else "")
        gate_up, gate_up_bias, down, down_bias = (out.pop(n) for n in names)
        E, D, F = cfg.moe_experts, cfg.d_model, cfg.d_ff
        for name, tensor, shape in zip(names, (gate_up, gate_up_bias, down, down_bias),
                                       ((E, D, 2 * F), (E, 2 * F), (E, F, D), (E, D))):
            ensure(tuple(tensor.shape) == shape, f"{name} has shape {tuple(tensor.shape)}, the config says {shape}")
        for e in range(E):
            out[f"{prefix}{e}.gate_proj.weight"] = gate_up[e][:, 0::2].t()
            out[f"{prefix}{e}.up_proj.weight"] = gate_up[e][:, 1::2].t()
            out[f"{prefix}{e}.gate_proj.bias"] = gate_up_bias[e][0::2]
            out[f"{prefix}{e}.up_proj.bias"] = gate_up_bias[e][1::2]
            out[f"{prefix}{e}.down_proj.weight"] = down[e].t()
            out[f"{prefix}{e}.down_proj.bias"] = down_bias[e]
    return out


def split_stacks(out: Tensors, prefix: str, cfg: ModelConfig) -> Tensors:
    """llama.cpp's experts (gate and up (E, F, D), down (E, D, F), each with its bias) as each expert's own,
    popped from `out`."""
    experts = {}
    for part in ("gate_proj", "up_proj", "down_proj"):
        weight, bias = out.pop(f"{prefix}{part}.weight"), out.pop(f"{prefix}{part}.bias", None)
        ensure(bias is not None and weight.dim() == 3 and weight.shape[0] == cfg.moe_experts,
               f"{prefix}{part} must be {cfg.moe_experts} stacked experts with their bias")
        for e in range(cfg.moe_experts):
            experts[f"{prefix}{e}.{part}.weight"], experts[f"{prefix}{e}.{part}.bias"] = weight[e], bias[e]
    return experts


def stacked(tensors: Tensors, cfg: ModelConfig) -> Tensors:
    """unstacked's inverse: each layer's experts as the four stacked tensors transformers keeps."""
    out = {}
    groups: dict[str, dict[str, list]] = {}
    for name, tensor in tensors.items():
        if ".mlp.experts." not in name:
            out[name] = tensor
            continue
        prefix, _, rest = name.partition(".mlp.experts.")
        groups.setdefault(prefix, {})[rest] = tensor
    for prefix, parts in groups.items():
        experts = range(cfg.moe_experts)
        gate_up = torch.stack([torch.stack((parts[f"{e}.gate_proj.weight"].t(), parts[f"{e}.up_proj.weight"].t()),
                                           dim=-1).flatten(-2) for e in experts])  # (E, D, 2F) interleaved
        gate_up_bias = torch.stack([torch.stack((parts[f"{e}.gate_proj.bias"], parts[f"{e}.up_proj.bias"]),
                                                dim=-1).flatten() for e in experts])
        base = f"{prefix}.mlp.experts."
        out.update({base + "gate_up_proj": gate_up.contiguous(), base + "gate_up_proj_bias": gate_up_bias,
                    base + "down_proj": torch.stack([parts[f"{e}.down_proj.weight"].t() for e in experts]).contiguous(),
                    base + "down_proj_bias": torch.stack([parts[f"{e}.down_proj.bias"] for e in experts])})
    return out


FP4 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)  # E2M1's 16 values


def mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """OCP MXFP4, as the released gpt-oss keeps its experts: blocks (E, rows, G, 16) bytes, two 4-bit E2M1 codes
    each (the low nibble first), scales (E, rows, G) E8M0 bytes, one power of two 2^(s - 127) per 32 values.
    Returns (E, G * 32, rows) in float32: transformers' parameter layout, (in, out) per expert."""
    ensure(blocks.dtype == torch.uint8 and scales.dtype == torch.uint8 and blocks.shape[:-1] == scales.shape
           and blocks.shape[-1] == 16, f"MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} must be "
                                       "uint8 (.., G, 16) and (.., G)")
    lut = torch.tensor(FP4, dtype=torch.float32)
    codes = torch.stack((blocks & 0x0F, blocks >> 4), dim=-1).flatten(-2).long()  # (E, rows, G, 32)
    values = torch.ldexp(lut[codes], scales.to(torch.int32)[..., None] - 127)
    return values.flatten(-2).transpose(1, 2).contiguous()


def dequantized(tensors: Tensors) -> Tensors:
    """Each MXFP4 pair (…_blocks, …_scales) as the float tensor of the name without the suffix."""
    out = {}
    for name, tensor in tensors.items():
        if name.endswith("_scales"):
            continue
        if name.endswith("_blocks"):
            base = name.removesuffix("_blocks")
            ensure(base + "_scales" in tensors, f"{name} comes with {base}_scales")
            out[base] = mxfp4(tensor, tensors[base + "_scales"])
        else:
            out[name] = tensor
    return out


def to_qkv(tensors: Tensors, cfg: ModelConfig) -> Tensors:
    return import_tensors(unstacked(dequantized(tensors), cfg), rules(cfg),
                          lambda name: cfg.tie_embeddings and name == "lm_head.weight")


def to_hf(tensors: Tensors, cfg: ModelConfig) -> Tensors:
    return stacked(rename(tensors, rules(cfg), to_hf=True), cfg)


def exports(cfg: ModelConfig) -> bool:
    kinds = set(cfg.layer_types) <= {"sliding", "global"}
    return (cfg.arch == "decoder" and cfg.attn_sinks and cfg.ffn == "glu_clamped" and cfg.moe_router_bias
            and cfg.moe_experts > 0 and cfg.moe_norm_topk and cfg.moe_scoring == "softmax" and cfg.moe_scale == 1.0
            and cfg.moe_groups <= 1 and not cfg.moe_choice_bias and not cfg.moe_shared_experts
            and not cfg.moe_dense_layers and cfg.moe_d_ff in (0, cfg.d_ff) and cfg.positional == "rope"
            and cfg.norm == "rmsnorm" and cfg.norm_placement == "pre" and kinds and not cfg.rope_local_theta
            and not cfg.qk_norm and not cfg.attn_softcap and not cfg.logit_softcap and not cfg.mla_kv_rank
            and not cfg.embed_scale and not cfg.bigram_vocab and not cfg.query_scale and not cfg.moe_capacity_factor
            and cfg.rope_scaling in ("none", "yarn") and not cfg.rope_dims)


def hf_config(cfg: ModelConfig) -> tuple[str, dict]:
    ensure(exports(cfg), "not a gpt-oss model")
    kinds = cfg.layer_types or ("global",) * cfg.n_layers
    return ARCHITECTURE, {
        "model_type": "gpt_oss", "vocab_size": cfg.vocab_size, "hidden_size": cfg.d_model,
        "intermediate_size": cfg.d_ff, "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.kv_heads, "head_dim": cfg.head_dim, "num_local_experts": cfg.moe_experts,
        "num_experts_per_tok": cfg.moe_top_k, "max_position_embeddings": cfg.max_seq_len,
        "rms_norm_eps": cfg.norm_eps, "attention_bias": cfg.bias, "tie_word_embeddings": cfg.tie_embeddings,
        "layer_types": [{v: k for k, v in KINDS.items()}[kind] for kind in kinds],
        "sliding_window": cfg.sliding_window or None, "swiglu_limit": CLAMP_LIMIT, "swiglu_alpha": CLAMP_ALPHA,
        "rope_parameters": rope_parameters(cfg), "hidden_act": "silu", "router_aux_loss_coef": 0.001,
        "output_router_logits": False}


HF_FAMILIES.register("gpt_oss")(HfFamily(
    model_type="gpt_oss", architectures=(ARCHITECTURE,), config=config, to_qkv=to_qkv, hf_config=hf_config,
    to_hf=to_hf, exports=exports, exports_doc="gpt_oss: sinks, clamped SwiGLU experts, a router bias"))
