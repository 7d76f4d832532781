"""The only place that reads ModelConfig: it looks every variant up in its registry and assembles
the modules, which themselves take plain arguments."""
from __future__ import annotations

from typing import Callable

from torch import nn

from qkv.config import ModelConfig
from qkv.models.decoder import DecoderLM
from qkv.nn.attention import Attention
from qkv.nn.block import Block
from qkv.nn.ffn import FFNS
from qkv.nn.init import INITS
from qkv.nn.norms import NORMS
from qkv.nn.positional import POSITIONALS
from qkv.nn.residual import RESIDUALS
from qkv.registry import Registry

ARCHITECTURES: Registry[Callable[[ModelConfig], nn.Module]] = Registry("architecture")


def build_model(cfg: ModelConfig) -> nn.Module:
    """Validate `cfg`, build the model and initialise it with `cfg.init`."""
    cfg.validate()
    model = ARCHITECTURES.get(cfg.arch)(cfg)
    INITS.get(cfg.init)(model, std=cfg.init_std, n_layers=cfg.decoder_layers)
    return model


def norm(cfg: ModelConfig) -> nn.Module:
    return NORMS.get(cfg.norm)(cfg.d_model, eps=cfg.norm_eps, bias=cfg.bias)


def positional(cfg: ModelConfig) -> nn.Module:
    return POSITIONALS.get(cfg.positional)(
        d_model=cfg.d_model, n_heads=cfg.n_heads, head_dim=cfg.head_dim, max_seq_len=cfg.max_seq_len,
        rope_theta=cfg.rope_theta, max_distance=cfg.max_distance)


def attention(cfg: ModelConfig) -> Attention:
    return Attention(cfg.d_model, cfg.n_heads, cfg.kv_heads, kernel=cfg.attention, bias=cfg.bias,
                     dropout=cfg.dropout)


def ffn(cfg: ModelConfig) -> nn.Module:
    return FFNS.get(cfg.ffn)(cfg.d_model, cfg.d_ff, activation=cfg.activation, bias=cfg.bias,
                             dropout=cfg.dropout)


def block(cfg: ModelConfig, cross: bool = False) -> Block:
    return Block(attn=attention(cfg), ffn=ffn(cfg), attn_norm=norm(cfg), ffn_norm=norm(cfg),
                 residual=RESIDUALS.get(cfg.norm_placement),
                 cross_attn=attention(cfg) if cross else None, cross_norm=norm(cfg) if cross else None)


def final_norm(cfg: ModelConfig) -> nn.Module:
    """Pre-LN stacks end with a norm (GPT-2's ln_f); Post-LN blocks already end in one."""
    return norm(cfg) if cfg.norm_placement == "pre" else nn.Identity()


@ARCHITECTURES.register("decoder")
def decoder(cfg: ModelConfig) -> DecoderLM:
    tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
    lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
    if cfg.tie_embeddings:
        lm_head.weight = tok_emb.weight  # W_out = W_E (note 003: the vocabulary projection is shared)
    return DecoderLM(tok_emb=tok_emb, positional=positional(cfg),
                     blocks=[block(cfg) for _ in range(cfg.decoder_layers)], final_norm=final_norm(cfg),
                     lm_head=lm_head, dropout=cfg.dropout, max_seq_len=cfg.max_seq_len)
