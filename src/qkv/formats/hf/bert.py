"""BERT (Devlin et al. 2019; transformers' modeling_bert.py) <-> qkv's encoder.

Post-LN blocks, GELU, learned absolute positions, token-type embeddings, a LayerNorm on the summed
embeddings, biases everywhere. `BertModel` -> the bare encoder (hidden states; its pooler is not part of a
qkv encoder and is dropped), `BertForMaskedLM` -> head "mlm", `BertForSequenceClassification` -> head
"classifier" (pooling "first": BERT's pooler reads [CLS]). Checkpoints of `BertModel` have no "bert."
prefix; the task models do.
"""
from __future__ import annotations

from qkv.config import ModelConfig
from qkv.formats.hf.common import (HF_FAMILIES, HfFamily, Rule, Tensors, activation_from_hf, activation_to_hf,
                                   block_rules, ensure, import_tensors, linear, need, plain, refuse, rename,
                                   strip_prefix)

HEADS = {"BertModel": "none", "BertForMaskedLM": "mlm", "BertForSequenceClassification": "classifier"}
ARCHITECTURE = {head: arch for arch, head in HEADS.items()}
PREFIX = "bert."


def config(hf: dict, architecture: str) -> ModelConfig:
    refuse(hf, "position_embedding_type", "absolute", "relative position embeddings in BERT")
    refuse(hf, "is_decoder", False, "BERT as a decoder")
    head = HEADS[architecture]
    n_classes = (len(hf.get("id2label") or {}) or hf.get("num_labels", 2)) if head == "classifier" else 0
    return ModelConfig(
        arch="encoder", head=head, vocab_size=need(hf, "vocab_size"), d_model=need(hf, "hidden_size"),
        n_heads=need(hf, "num_attention_heads"), n_layers=need(hf, "num_hidden_layers"),
        d_ff=need(hf, "intermediate_size"), max_seq_len=hf.get("max_position_embeddings", 512),
        positional="learned", norm="layernorm", norm_eps=hf.get("layer_norm_eps", 1e-12), norm_placement="post",
        activation=activation_from_hf(hf.get("hidden_act", "gelu"), "hidden_act"), ffn="mlp", bias=True,
        type_vocab_size=hf.get("type_vocab_size", 2), embed_norm=True, n_classes=n_classes, pooling="first",
        tie_embeddings=hf.get("tie_word_embeddings", True), dropout=0.0)


def encoder_rules(cfg: ModelConfig, qkv: str, hf: str) -> list[Rule]:
    """The encoder stack: qkv names under `qkv`, BERT's under `hf` (both "" for a bare encoder)."""
    names = (("q", "query"), ("k", "key"), ("v", "value"))
    pairs = ([pair for a, b in names for pair in linear(f"attn.{a}_proj", f"attention.self.{b}", True)]
             + linear("attn.o_proj", "attention.output.dense", True)
             + linear("attn_norm", "attention.output.LayerNorm", True)
             + linear("ffn.up_proj", "intermediate.dense", True) + linear("ffn.down_proj", "output.dense", True)
             + linear("ffn_norm", "output.LayerNorm", True))
    embeddings = [("tok_emb", "word_embeddings"), ("type_emb", "token_type_embeddings"),
                  ("positional", "position_embeddings")]
    return ([Rule(f"{qkv}{a}.weight", f"{hf}embeddings.{b}.weight") for a, b in embeddings]
            + [Rule(f"{qkv}embed_norm.{p}", f"{hf}embeddings.LayerNorm.{p}") for p in ("weight", "bias")]
            + block_rules(cfg.n_layers, f"{qkv}blocks.", f"{hf}encoder.layer.", pairs))


def head_rules(cfg: ModelConfig) -> list[Rule]:
    if cfg.head == "mlm":
        pairs = (linear("head.transform", "cls.predictions.transform.dense", True)
                 + linear("head.norm", "cls.predictions.transform.LayerNorm", True)
                 + [("head.decoder.bias", "cls.predictions.bias")]
                 + ([] if cfg.tie_embeddings else [("head.decoder.weight", "cls.predictions.decoder.weight")]))
    elif cfg.head == "classifier":
        pairs = linear("head.pooler", "bert.pooler.dense", True) + linear("head.out_proj", "classifier", True)
    else:
        pairs = []
    return [Rule(a, b) for a, b in pairs]


def rules(cfg: ModelConfig) -> list[Rule]:
    if cfg.head == "none":
        return encoder_rules(cfg, "", "")
    return encoder_rules(cfg, "encoder.", PREFIX) + head_rules(cfg)


def ignored(cfg: ModelConfig):
    def check(name: str) -> bool:  # buffers; a bare encoder has no pooler; a tied decoder duplicates W_E
        return (name.endswith(("position_ids", "token_type_ids")) or (cfg.head != "classifier" and "pooler." in name)
                or name in ("cls.predictions.decoder.bias", "cls.seq_relationship.weight", "cls.seq_relationship.bias")
                or (cfg.tie_embeddings and name == "cls.predictions.decoder.weight"))
    return check


def to_qkv(tensors: Tensors, cfg: ModelConfig) -> Tensors:
    if cfg.head == "none":  # a task checkpoint read as a bare encoder: drop the prefix
        tensors = strip_prefix(tensors, PREFIX, "embeddings.word_embeddings.weight")
    else:  # a BertModel checkpoint under a task class: add it
        tensors = {(n if n.startswith((PREFIX, "cls.", "classifier.")) else PREFIX + n): t for n, t in tensors.items()}
    return import_tensors(tensors, rules(cfg), ignored(cfg))


def to_hf(tensors: Tensors, cfg: ModelConfig) -> Tensors:
    return rename(tensors, rules(cfg), to_hf=True)


def exports(cfg: ModelConfig) -> bool:
    return plain(cfg) and (cfg.arch == "encoder" and cfg.positional == "learned" and cfg.norm == "layernorm"
            and cfg.norm_placement == "post" and cfg.ffn == "mlp" and cfg.bias and cfg.embed_norm
            and not cfg.embed_scale and cfg.type_vocab_size > 0 and cfg.kv_heads == cfg.n_heads
            and not cfg.moe_experts and (cfg.head != "classifier" or cfg.pooling == "first"))


def hf_config(cfg: ModelConfig) -> tuple[str, dict]:
    ensure(exports(cfg), "not a BERT model")
    hf = {"model_type": "bert", "vocab_size": cfg.vocab_size, "hidden_size": cfg.d_model,
          "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads, "intermediate_size": cfg.d_ff,
          "hidden_act": activation_to_hf(cfg), "max_position_embeddings": cfg.max_seq_len,
          "type_vocab_size": cfg.type_vocab_size, "layer_norm_eps": cfg.norm_eps,
          "hidden_dropout_prob": cfg.dropout, "attention_probs_dropout_prob": cfg.dropout,
          "tie_word_embeddings": cfg.tie_embeddings, "position_embedding_type": "absolute"}
    if cfg.head == "classifier":
        hf["id2label"] = {str(i): f"LABEL_{i}" for i in range(cfg.n_classes)}
        hf["label2id"] = {f"LABEL_{i}": i for i in range(cfg.n_classes)}
    return ARCHITECTURE[cfg.head], hf


HF_FAMILIES.register("bert")(HfFamily(
    model_type="bert", architectures=tuple(HEADS), config=config, to_qkv=to_qkv, hf_config=hf_config,
    to_hf=to_hf, exports=exports,
    exports_doc="bert: encoder, learned positions, layernorm, post, mlp, bias, embed_norm, token types"))
