"""BART (Lewis et al. 2020; transformers' modeling_bart.py) <-> qkv's encoder-decoder.

Learned positions with an offset of 2 (BART's table has max_positions + 2 rows; position p reads row p + 2),
Post-LN blocks, GELU, a LayerNorm on the embeddings of both stacks, biases everywhere, one embedding matrix
shared by the encoder, the decoder and the (tied) head. The two unused rows of BART's tables are dropped on
import and written as zeros on export; `final_logits_bias` must be zero (qkv's head has no bias).
"""
from __future__ import annotations

import torch

from qkv.config import ModelConfig
from qkv.formats.hf.common import (HF_FAMILIES, HfFamily, Rule, Tensors, activation_from_hf, activation_to_hf,
                                   block_rules, ensure, import_tensors, is_zero, linear, need, plain, refuse, rename)

ARCHITECTURE = "BartForConditionalGeneration"
OFFSET = 2  # BartLearnedPositionalEmbedding.offset
POSITIONS = ("encoder.positional.weight", "positional.weight")


def config(hf: dict, architecture: str) -> ModelConfig:
    for key in ("encoder_attention_heads", "encoder_ffn_dim"):
        other = key.replace("encoder", "decoder")
        ensure(hf.get(key) == hf.get(other), f"{key}={hf.get(key)} != {other}={hf.get(other)}: "
                                             f"qkv's encoder and decoder share n_heads and d_ff")
    refuse(hf, "tie_word_embeddings", True, "an untied BART head")
    refuse(hf, "normalize_before", False, "Pre-LN BART (mBART)")
    refuse(hf, "add_final_layer_norm", False, "a final layer norm (mBART)")
    return ModelConfig(
        arch="encoder-decoder", vocab_size=need(hf, "vocab_size"), d_model=need(hf, "d_model"),
        n_heads=need(hf, "encoder_attention_heads"), n_layers=need(hf, "encoder_layers"),
        n_encoder_layers=need(hf, "encoder_layers"), n_decoder_layers=need(hf, "decoder_layers"),
        d_ff=need(hf, "encoder_ffn_dim"), max_seq_len=need(hf, "max_position_embeddings"), positional="learned",
        norm="layernorm", norm_eps=1e-5, norm_placement="post",  # BART's nn.LayerNorm default eps
        activation=activation_from_hf(hf.get("activation_function", "gelu"), "activation_function"),
        ffn="mlp", bias=True, embed_norm=True, embed_scale=bool(hf.get("scale_embedding", False)),
        tie_embeddings=True, dropout=0.0)


def layer_pairs(cross: bool) -> list[tuple[str, str]]:
    def attention(qkv: str, hf: str) -> list[tuple[str, str]]:
        return [pair for a, b in (("q", "q"), ("k", "k"), ("v", "v"), ("o", "out"))
                for pair in linear(f"{qkv}.{a}_proj", f"{hf}.{b}_proj", True)]

    pairs = attention("attn", "self_attn") + linear("attn_norm", "self_attn_layer_norm", True)
    if cross:
        pairs += attention("cross_attn", "encoder_attn") + linear("cross_norm", "encoder_attn_layer_norm", True)
    return pairs + linear("ffn.up_proj", "fc1", True) + linear("ffn.down_proj", "fc2", True) + linear(
        "ffn_norm", "final_layer_norm", True)


def stack_rules(qkv: str, hf: str, n_layers: int, cross: bool) -> list[Rule]:
    return ([Rule(f"{qkv}positional.weight", f"{hf}embed_positions.weight")]
            + [Rule(f"{qkv}embed_norm.{p}", f"{hf}layernorm_embedding.{p}") for p in ("weight", "bias")]
            + block_rules(n_layers, f"{qkv}blocks.", f"{hf}layers.", layer_pairs(cross)))


def rules(cfg: ModelConfig) -> list[Rule]:
    return ([Rule("tok_emb.weight", "model.shared.weight")]
            + stack_rules("encoder.", "model.encoder.", cfg.encoder_layers, cross=False)
            + stack_rules("", "model.decoder.", cfg.decoder_layers, cross=True))


def ignored(name: str) -> bool:  # copies of the shared embedding (tied); the zero logits bias (checked)
    return name in ("model.encoder.embed_tokens.weight", "model.decoder.embed_tokens.weight", "lm_head.weight",
                    "final_logits_bias")


def to_qkv(tensors: Tensors, cfg: ModelConfig) -> Tensors:
    ensure(is_zero(tensors.get("final_logits_bias")), "final_logits_bias is not zero: qkv's head has no bias")
    out = import_tensors(tensors, rules(cfg), ignored)
    for name in POSITIONS:
        out[name] = out[name][OFFSET:]  # row p + 2 holds position p
    return out


def to_hf(tensors: Tensors, cfg: ModelConfig) -> Tensors:
    tensors = dict(tensors)
    for name in POSITIONS:
        table = tensors[name]
        tensors[name] = torch.cat([table.new_zeros(OFFSET, table.shape[1]), table])
    out = rename(tensors, rules(cfg), to_hf=True)
    out["final_logits_bias"] = torch.zeros(1, cfg.vocab_size)
    return out


def exports(cfg: ModelConfig) -> bool:
    return plain(cfg) and (cfg.arch == "encoder-decoder" and cfg.positional == "learned" and cfg.norm == "layernorm"
            and cfg.norm_placement == "post" and cfg.ffn == "mlp" and cfg.bias and cfg.embed_norm
            and cfg.tie_embeddings and cfg.kv_heads == cfg.n_heads and not cfg.moe_experts)


def hf_config(cfg: ModelConfig) -> tuple[str, dict]:
    ensure(exports(cfg), "not a BART model")
    ensure(cfg.norm_eps == 1e-5, f"model.norm_eps={cfg.norm_eps}: BART's LayerNorms use 1e-5")
    return ARCHITECTURE, {
        "model_type": "bart", "vocab_size": cfg.vocab_size, "d_model": cfg.d_model,
        "encoder_layers": cfg.encoder_layers, "decoder_layers": cfg.decoder_layers,
        "encoder_attention_heads": cfg.n_heads, "decoder_attention_heads": cfg.n_heads,
        "encoder_ffn_dim": cfg.d_ff, "decoder_ffn_dim": cfg.d_ff, "max_position_embeddings": cfg.max_seq_len,
        "activation_function": activation_to_hf(cfg), "scale_embedding": cfg.embed_scale,
        "dropout": cfg.dropout, "attention_dropout": cfg.dropout, "activation_dropout": 0.0,
        "tie_word_embeddings": True, "is_encoder_decoder": True}


HF_FAMILIES.register("bart")(HfFamily(
    model_type="bart", architectures=(ARCHITECTURE,), config=config, to_qkv=to_qkv, hf_config=hf_config,
    to_hf=to_hf, exports=exports,
    exports_doc="bart: encoder-decoder, learned positions, layernorm (eps 1e-5), post, mlp, bias, embed_norm, tied"))
