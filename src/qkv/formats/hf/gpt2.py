"""GPT-2 (Radford et al. 2019; transformers' modeling_gpt2.py) <-> qkv's decoder LM.

Learned positions, Pre-LN with a final `ln_f`, GELU (tanh approximation, `gelu_new`), biases everywhere,
tied head. GPT-2's `Conv1D` stores its weight (in, out), the transpose of nn.Linear's (out, in); the fused
`c_attn` (D, 3D) holds W_Q | W_K | W_V side by side.
"""
from __future__ import annotations

import torch

from qkv.config import ModelConfig
from qkv.formats.hf.common import (HF_FAMILIES, HfFamily, Rule, Tensors, activation_from_hf, activation_to_hf,
                                   block_rules, ensure, import_tensors, linear, need, plain, refuse, rename,
                                   strip_prefix)

ARCHITECTURE = "GPT2LMHeadModel"
PREFIX = "transformer."  # GPT2LMHeadModel's base model; checkpoints of GPT2Model (and OpenAI's) lack it
QKV = ("q", "k", "v")


def config(hf: dict, architecture: str) -> ModelConfig:
    refuse(hf, "scale_attn_weights", True, "attention without the 1/sqrt(Dh) scale")
    refuse(hf, "scale_attn_by_inverse_layer_idx", False, "per-layer attention scaling")
    refuse(hf, "add_cross_attention", False, "cross-attention in GPT-2")
    d_model = need(hf, "n_embd")
    return ModelConfig(
        arch="decoder", vocab_size=need(hf, "vocab_size"), d_model=d_model, n_heads=need(hf, "n_head"),
        n_layers=need(hf, "n_layer"), d_ff=hf.get("n_inner") or 4 * d_model, max_seq_len=need(hf, "n_positions"),
        positional="learned", norm="layernorm", norm_eps=hf.get("layer_norm_epsilon", 1e-5), norm_placement="pre",
        activation=activation_from_hf(hf.get("activation_function", "gelu_new"), "activation_function"),
        ffn="mlp", bias=True, tie_embeddings=hf.get("tie_word_embeddings", True),
        dropout=0.0)  # qkv loads checkpoints for inference and fine-tuning; set model.dropout to train with it


def rules(cfg: ModelConfig) -> list[Rule]:
    """qkv name <-> GPT-2 name (without the `transformer.` prefix). The q/k/v names `attn.c_attn.q` are
    the three column blocks of `c_attn`, split and joined by `split_qkv` / `join_qkv`."""
    pairs = (linear("attn_norm", "ln_1", True)
             + [pair for name in QKV for pair in linear(f"attn.{name}_proj", f"attn.c_attn.{name}", True)]
             + linear("attn.o_proj", "attn.c_proj", True) + linear("ffn_norm", "ln_2", True)
             + linear("ffn.up_proj", "mlp.c_fc", True) + linear("ffn.down_proj", "mlp.c_proj", True))
    conv1d = tuple(f"{a}.weight" for a in ("attn.q_proj", "attn.k_proj", "attn.v_proj", "attn.o_proj",
                                           "ffn.up_proj", "ffn.down_proj"))
    head = [] if cfg.tie_embeddings else [Rule("lm_head.weight", "lm_head.weight")]
    return ([Rule("tok_emb.weight", "wte.weight"), Rule("positional.weight", "wpe.weight")]
            + block_rules(cfg.n_layers, "blocks.", "h.", pairs, transpose=conv1d)
            + [Rule(f"final_norm.{p}", f"ln_f.{p}") for p in ("weight", "bias")] + head)


def split_qkv(tensors: Tensors, n_layers: int) -> Tensors:
    """c_attn weight (D, 3D) -> three (D, D) column blocks; bias (3D,) -> three (D,)."""
    out = dict(tensors)
    for i in range(n_layers):
        for kind in ("weight", "bias"):
            fused = out.pop(f"h.{i}.attn.c_attn.{kind}", None)
            if fused is None:
                continue  # rename reports the missing tensor by its (split) name
            for name, part in zip(QKV, fused.chunk(3, dim=-1)):
                out[f"h.{i}.attn.c_attn.{name}.{kind}"] = part
    return out


def join_qkv(tensors: Tensors, n_layers: int) -> Tensors:
    out = dict(tensors)
    for i in range(n_layers):
        for kind in ("weight", "bias"):
            parts = [out.pop(f"h.{i}.attn.c_attn.{name}.{kind}") for name in QKV]
            out[f"h.{i}.attn.c_attn.{kind}"] = torch.cat(parts, dim=-1).contiguous()
    return out


def ignored(cfg: ModelConfig):
    def check(name: str) -> bool:  # the causal-mask buffers of old checkpoints; a tied head's duplicate
        return name.endswith((".attn.bias", ".attn.masked_bias")) or (cfg.tie_embeddings and name == "lm_head.weight")
    return check


def to_qkv(tensors: Tensors, cfg: ModelConfig) -> Tensors:
    tensors = split_qkv(strip_prefix(tensors, PREFIX, "wte.weight"), cfg.n_layers)
    return import_tensors(tensors, rules(cfg), ignored(cfg))


def to_hf(tensors: Tensors, cfg: ModelConfig) -> Tensors:
    out = join_qkv(rename(tensors, rules(cfg), to_hf=True), cfg.n_layers)
    return {(name if name == "lm_head.weight" else PREFIX + name): t for name, t in out.items()}


def exports(cfg: ModelConfig) -> bool:
    return plain(cfg) and (cfg.arch == "decoder" and cfg.positional == "learned" and cfg.norm == "layernorm"
            and cfg.norm_placement == "pre" and cfg.ffn == "mlp" and cfg.bias and cfg.kv_heads == cfg.n_heads
            and not cfg.moe_experts)


def hf_config(cfg: ModelConfig) -> tuple[str, dict]:
    ensure(exports(cfg), "not a GPT-2 model")
    return ARCHITECTURE, {
        "model_type": "gpt2", "vocab_size": cfg.vocab_size, "n_positions": cfg.max_seq_len, "n_embd": cfg.d_model,
        "n_layer": cfg.n_layers, "n_head": cfg.n_heads, "n_inner": cfg.d_ff,
        "activation_function": activation_to_hf(cfg), "layer_norm_epsilon": cfg.norm_eps,
        "resid_pdrop": cfg.dropout, "embd_pdrop": cfg.dropout, "attn_pdrop": cfg.dropout,
        "tie_word_embeddings": cfg.tie_embeddings}


HF_FAMILIES.register("gpt2")(HfFamily(
    model_type="gpt2", architectures=(ARCHITECTURE,), config=config, to_qkv=to_qkv, hf_config=hf_config,
    to_hf=to_hf, exports=exports,
    exports_doc="gpt2: decoder, learned positions, layernorm, pre, mlp, bias, MHA"))
