"""T5 (Raffel et al. 2020; transformers' modeling_t5.py) <-> qkv's encoder-decoder.

Relative bucketed position bias (one table per stack, shared by its layers: qkv's "t5" positional in the
encoder, its causal twin in the decoder), RMSNorm ("T5LayerNorm": no mean, no bias), Pre-LN with a final
norm in each stack, no biases, ReLU FFN or gated GELU (T5 v1.1: wi_0 gated, wi_1 linear).

Two folds keep qkv's modules unchanged (docs/DEVIATIONS.md):
- T5 does not scale scores by 1/sqrt(Dh): W_Q is multiplied by sqrt(Dh) on import (divided on export);
- with a tied head T5 multiplies the decoder output by D^-1/2 before it: the decoder's final RMSNorm gain
  is multiplied by D^-1/2 on import (divided on export).
Both are exact in real arithmetic and change fp32 results by rounding only; where sqrt(Dh) and sqrt(D) are
powers of two (Dh, D powers of four) they are exact in floating point as well.
"""
from __future__ import annotations

import math

from qkv.config import ModelConfig
from qkv.formats.hf.common import (HF_FAMILIES, HfFamily, Rule, Tensors, activation_to_hf, block_rules, ensure,
                                   import_tensors, linear, need, plain, rename)
from qkv.nn.relative import T5_BUCKETS

ARCHITECTURE = "T5ForConditionalGeneration"
FFNS = {"relu": ("mlp", "relu"), "gated-gelu": ("glu", "gelu_tanh")}  # feed_forward_proj -> (ffn, activation)


def config(hf: dict, architecture: str) -> ModelConfig:
    d_model, n_heads = need(hf, "d_model"), need(hf, "num_heads")
    ensure(need(hf, "d_kv") * n_heads == d_model, f"d_kv={hf['d_kv']} x num_heads={n_heads} != "
                                                  f"d_model={d_model}: qkv needs D = H * Dh")
    projection = hf.get("feed_forward_proj", "relu")
    ensure(projection in FFNS, f"feed_forward_proj={projection!r} is not supported by qkv; "
                               f"supported: {', '.join(FFNS)}")
    ffn, activation = FFNS[projection]
    layers = need(hf, "num_layers")
    # transformers 5 ties T5 always and keeps the old flag as `scale_decoder_outputs` (original T5: True,
    # v1.1: False); 4.x configs have only tie_word_embeddings
    tied = hf.get("scale_decoder_outputs", hf.get("tie_word_embeddings", True))
    return ModelConfig(
        arch="encoder-decoder", vocab_size=need(hf, "vocab_size"), d_model=d_model, n_heads=n_heads,
        n_layers=layers, n_encoder_layers=layers, n_decoder_layers=hf.get("num_decoder_layers") or layers,
        d_ff=need(hf, "d_ff"), max_seq_len=hf.get("n_positions", 512), positional="t5",
        max_distance=hf.get("relative_attention_max_distance", 128),
        t5_buckets=hf.get("relative_attention_num_buckets", T5_BUCKETS), norm="rmsnorm",
        norm_eps=hf.get("layer_norm_epsilon", 1e-6), norm_placement="pre", ffn=ffn, activation=activation,
        bias=False, tie_embeddings=tied, dropout=0.0)


def layer_pairs(cfg: ModelConfig, cross: bool) -> list[tuple[str, str]]:
    def attention(qkv: str, hf: str) -> list[tuple[str, str]]:
        return [pair for a in "qkvo" for pair in linear(f"{qkv}.{a}_proj", f"{hf}.{a}", False)]

    pairs = attention("attn", "layer.0.SelfAttention") + linear("attn_norm", "layer.0.layer_norm", False)
    if cross:
        pairs += attention("cross_attn", "layer.1.EncDecAttention") + linear("cross_norm", "layer.1.layer_norm", False)
    ffn = f"layer.{2 if cross else 1}"
    if cfg.ffn == "glu":
        pairs += (linear("ffn.gate_proj", f"{ffn}.DenseReluDense.wi_0", False)
                  + linear("ffn.up_proj", f"{ffn}.DenseReluDense.wi_1", False))
    else:
        pairs += linear("ffn.up_proj", f"{ffn}.DenseReluDense.wi", False)
    return (pairs + linear("ffn.down_proj", f"{ffn}.DenseReluDense.wo", False)
            + linear("ffn_norm", f"{ffn}.layer_norm", False))


def stack_rules(cfg: ModelConfig, qkv: str, hf: str, n_layers: int, cross: bool) -> list[Rule]:
    return ([Rule(f"{qkv}positional.relative_attention_bias.weight",
                  f"{hf}block.0.layer.0.SelfAttention.relative_attention_bias.weight"),
             Rule(f"{qkv}final_norm.weight", f"{hf}final_layer_norm.weight")]
            + block_rules(n_layers, f"{qkv}blocks.", f"{hf}block.", layer_pairs(cfg, cross)))


def rules(cfg: ModelConfig) -> list[Rule]:
    untied = [] if cfg.tie_embeddings else [Rule("encoder.tok_emb.weight", "shared.weight"),
                                            Rule("lm_head.weight", "lm_head.weight")]
    return ([Rule("tok_emb.weight", "shared.weight")] + untied
            + stack_rules(cfg, "encoder.", "encoder.", cfg.encoder_layers, cross=False)
            + stack_rules(cfg, "", "decoder.", cfg.decoder_layers, cross=True))


def scales(cfg: ModelConfig) -> dict[str, float]:
    """qkv tensor = HF tensor * scale (see the module docstring)."""
    stacks = (("encoder.", cfg.encoder_layers, ("attn",)), ("", cfg.decoder_layers, ("attn", "cross_attn")))
    q = {f"{stack}blocks.{i}.{attn}.q_proj.weight": math.sqrt(cfg.head_dim)
         for stack, n, attns in stacks for i in range(n) for attn in attns}
    return {**q, **({"final_norm.weight": cfg.d_model ** -0.5} if cfg.tie_embeddings else {})}


def ignored(name: str) -> bool:  # the stacks' copies of the shared embedding
    return name in ("encoder.embed_tokens.weight", "decoder.embed_tokens.weight")


def to_qkv(tensors: Tensors, cfg: ModelConfig) -> Tensors:
    if not cfg.tie_embeddings and "lm_head.weight" not in tensors:  # saved with the head tied to shared
        tensors = {**tensors, "lm_head.weight": tensors.get("shared.weight")}
    out = import_tensors(tensors, rules(cfg), lambda n: ignored(n) or (cfg.tie_embeddings and n == "lm_head.weight"))
    factors = scales(cfg)
    return {name: t * factors[name] if name in factors else t for name, t in out.items()}


def to_hf(tensors: Tensors, cfg: ModelConfig) -> Tensors:
    if not cfg.tie_embeddings:
        ensure(bool((tensors["encoder.tok_emb.weight"] == tensors["tok_emb.weight"]).all()),
               "T5 shares one embedding between encoder and decoder; this model's differ")
    factors = scales(cfg)
    tensors = {name: t / factors[name] if name in factors else t for name, t in tensors.items()}
    # the untied encoder embedding and tok_emb both map to shared.weight: rename keeps the last, equal one
    return rename(tensors, rules(cfg), to_hf=True)


def exports(cfg: ModelConfig) -> bool:
    return plain(cfg) and (cfg.arch == "encoder-decoder" and cfg.positional == "t5" and cfg.norm == "rmsnorm"
            and cfg.norm_placement == "pre" and not cfg.bias and not cfg.embed_norm and not cfg.embed_scale
            and (cfg.ffn, cfg.activation) in FFNS.values() and cfg.kv_heads == cfg.n_heads and not cfg.moe_experts)


def hf_config(cfg: ModelConfig) -> tuple[str, dict]:
    ensure(exports(cfg), "not a T5 model")
    projection = {value: key for key, value in FFNS.items()}[(cfg.ffn, cfg.activation)]
    return ARCHITECTURE, {
        "model_type": "t5", "vocab_size": cfg.vocab_size, "d_model": cfg.d_model, "d_kv": cfg.head_dim,
        "d_ff": cfg.d_ff, "num_heads": cfg.n_heads, "num_layers": cfg.encoder_layers,
        "num_decoder_layers": cfg.decoder_layers, "relative_attention_num_buckets": cfg.t5_buckets,
        "relative_attention_max_distance": cfg.max_distance, "layer_norm_epsilon": cfg.norm_eps,
        "feed_forward_proj": projection, "dense_act_fn": activation_to_hf(cfg), "is_gated_act": cfg.ffn == "glu",
        "dropout_rate": cfg.dropout, "tie_word_embeddings": cfg.tie_embeddings, "is_encoder_decoder": True,
        "n_positions": cfg.max_seq_len}


HF_FAMILIES.register("t5")(HfFamily(
    model_type="t5", architectures=(ARCHITECTURE,), config=config, to_qkv=to_qkv, hf_config=hf_config,
    to_hf=to_hf, exports=exports,
    exports_doc="t5: encoder-decoder, t5 positional, rmsnorm, pre, no bias, mlp+relu or glu+gelu_tanh"))
