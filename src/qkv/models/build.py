"""The only place that reads ModelConfig: it looks every variant up in its registry and assembles
the modules, which themselves take plain arguments."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from qkv.config import ModelConfig
from qkv.errors import QkvError
from qkv.models.decoder import DecoderLM
from qkv.models.encoder import Encoder
from qkv.models.encoder_decoder import EncoderDecoder
from qkv.models.heads import POOLINGS, ClassifierHead, EncoderClassifier, EncoderMLM, MLMHead
from qkv.plan import LayerPlan, check_plan, layer_plans, rope_scaling
from qkv.nn import registries
from qkv.nn.attention import Attention
from qkv.nn.mla import LatentAttention
from qkv.nn.block import Block
from qkv.nn.ffn import ACTIVATIONS, FFNS
from qkv.nn.linear_cross_entropy import SoftCapHead
from qkv.nn.init import INITS
from qkv.nn.kernels import KERNELS
from qkv.nn.norms import NORMS
from qkv.nn.positional import POSITIONALS, Positional, Rotary
from qkv.nn.moe import MoE, Routing
from qkv.nn.residual import RESIDUALS, sublayer_norm
from qkv.registry import Registry



@dataclass(frozen=True)
class Architecture:
    """One model family (model.arch): how to build it, and everything other places ask of it."""

    build: Callable[[ModelConfig], nn.Module]
    classes: tuple[type, ...]  # what it builds: a finished model is told by its class (architecture_of)
    objective: str  # what train.objective=auto trains (qkv.train.objectives)
    prompt: str | None  # how generate feeds it (qkv.generate.families.PROMPTS); None: it writes no text
    embeds: bool  # its hidden states are the text's embedding (qkv serve's /v1/embeddings)


ARCHITECTURES: Registry[Architecture] = Registry("architecture")
HEADS: Registry[Callable[[ModelConfig, Encoder], nn.Module]] = Registry("encoder head")  # model.head


def check_model(cfg: ModelConfig) -> ModelConfig:
    """cfg.validate(), every variant name by its registry, and the chosen entries' facts against the sizes."""
    cfg.validate()
    ARCHITECTURES.check("model.arch", cfg.arch)
    HEADS.check("model.head", cfg.head)
    POOLINGS.check("model.pooling", cfg.pooling)
    for axis, registry in registries.AXES.items():
        registry.check(f"model.{axis}", getattr(cfg, axis))
    if POSITIONALS.get(cfg.positional).even_head_dim and cfg.head_dim % 2:
        raise QkvError(f"model.positional={cfg.positional!r} needs an even head width, got {cfg.head_dim}")
    if KERNELS.get(cfg.attention).windowed and cfg.window < 1:
        raise QkvError(f"model.attention={cfg.attention!r} needs model.window >= 1, got {cfg.window}")
    if (cfg.attn_softcap or cfg.layer_types or cfg.attn_sinks) and cfg.attention not in ("sdpa", "naive"):
        raise QkvError(f"model.attention={cfg.attention!r}: soft-capped scores, attention sinks and a per-layer plan "
                       "need a dense kernel (sdpa or naive)")
    check_plan(cfg)
    return cfg


def build_model(cfg: ModelConfig) -> nn.Module:
    """Check `cfg`, build the model and initialise it with `cfg.init`."""
    check_model(cfg)
    model = ARCHITECTURES.get(cfg.arch).build(cfg)
    if any(p.is_meta for p in model.parameters()):  # built on the meta device for a file's weights (a loader):
        return model  # nothing to draw (and torch's meta normal_ would import TorchDynamo, about 1 s)
    depth = cfg.encoder_layers if cfg.arch == "encoder" else cfg.decoder_layers
    INITS.get(cfg.init)(model, std=cfg.init_std, n_layers=depth)
    if getattr(model, "bigram_emb", None) is not None:
        nn.init.zeros_(model.bigram_emb.weight)  # every scheme: the bigram table starts as no change (modded-nanogpt)
    return model


def architecture_of(model: nn.Module) -> Architecture:
    """The entry of a finished model (by its class, or a base class of it)."""
    for name in ARCHITECTURES.names():
        if isinstance(model, ARCHITECTURES.get(name).classes):
            return ARCHITECTURES.get(name)
    raise QkvError(f"a {type(model).__name__} is not a qkv model; qkv builds "
                   f"{', '.join(cls.__name__ for n in ARCHITECTURES.names() for cls in ARCHITECTURES.get(n).classes)}")


def objective_of(cfg) -> str:
    """The objective a RunConfig trains (its model was trained with): train.objective, or for auto its
    architecture's own. What `qkv eval`, `generate` and `classify` ask of a run before they use it."""
    return ARCHITECTURES.get(cfg.model.arch).objective if cfg.train.objective == "auto" else cfg.train.objective


def use_of(cfg) -> str:
    """What a run's model is for once trained (qkv generate, eval, serve): its objective, except that a model
    fine-tuned by SFT or DPO (qkv.train.sft) is a language model like any other: "lm"."""
    objective = objective_of(cfg)
    return "lm" if objective in ("sft", "dpo") else objective


def norm(cfg: ModelConfig) -> nn.Module:
    return NORMS.get(cfg.norm)(cfg.d_model, eps=cfg.norm_eps, bias=cfg.bias)


def positional(cfg: ModelConfig, causal: bool = True, name: str | None = None) -> nn.Module:
    """`causal` says whether the stack is masked causally (decoders) or not (encoders); an encoding whose
    form depends on it may read it, the others ignore it. `name` overrides cfg.positional."""
    return POSITIONALS.get(name or cfg.positional)(  # (latent attention turns its rope dims alone: qkv.nn.mla)
        d_model=cfg.d_model, n_heads=cfg.n_heads, head_dim=cfg.mla_rope_dims or cfg.head_dim, max_seq_len=cfg.max_seq_len,
        rope_theta=cfg.rope_theta, max_distance=cfg.max_distance, t5_buckets=cfg.t5_buckets, causal=causal,
        rope_scaling=rope_scaling(cfg), rope_dims=cfg.rope_dims)


def decoder_positional(cfg: ModelConfig) -> nn.Module:
    """The encoder-decoder's decoder stack: the encoding's `decoder_twin` where it names one (T5's decoder
    spends all its buckets on the past)."""
    return positional(cfg, causal=True, name=POSITIONALS.get(cfg.positional).decoder_twin)


def attention(cfg: ModelConfig, cross: bool = False, plan: LayerPlan | None = None,
              own_positions: Positional | None = None) -> Attention | LatentAttention:
    """Self-attention with `cfg.attention`, as `plan` says for its layer (its window; `own_positions`: its
    rotation where it is not the model's). Cross-attention always attends to the whole source (note 000
    §8.4): a local window or a linear approximation of it has no meaning between two sequences."""
    kernel = cfg.attention if not cross or KERNELS.get(cfg.attention).full else "sdpa"
    if cfg.mla_kv_rank and not cross:
        return LatentAttention(cfg.d_model, cfg.n_heads, kv_rank=cfg.mla_kv_rank, q_rank=cfg.mla_q_rank,
                               head_dim=cfg.head_dim, rope_dims=cfg.mla_rope_dims, v_dim=cfg.mla_v_dims or cfg.head_dim,
                               norm_eps=cfg.norm_eps, kernel=kernel, bias=cfg.bias, dropout=cfg.dropout,
                               scale=cfg.query_scale ** -0.5 if cfg.query_scale else 0.0)
    return Attention(cfg.d_model, cfg.n_heads, cfg.kv_heads, kernel=kernel, bias=cfg.bias,
                     dropout=cfg.dropout, window=cfg.window, qk_norm_eps=cfg.norm_eps if cfg.qk_norm else None,
                     qk_norm_whole=cfg.qk_norm_whole,
                     head_dim=cfg.head_dim, sliding=plan.window if plan is not None else 0,
                     scale=cfg.query_scale ** -0.5 if cfg.query_scale else 0.0, softcap=cfg.attn_softcap,
                     positional=own_positions, sinks=cfg.attn_sinks and not cross)


def routing(cfg: ModelConfig) -> Routing:
    return Routing(scoring=cfg.moe_scoring, normalize=cfg.moe_norm_topk, scale=cfg.moe_scale, groups=cfg.moe_groups,
                   group_top_k=cfg.moe_group_top_k)


def ffn(cfg: ModelConfig, plan: LayerPlan | None = None) -> nn.Module:
    """The dense FFN `cfg.ffn`, or a mixture of moe_experts of them (moe_d_ff wide) where the layer's plan
    says (every layer of an encoder stack when moe_experts > 0)."""
    if plan.moe if plan is not None else cfg.moe_experts:
        return MoE(cfg.d_model, cfg.moe_d_ff or cfg.d_ff, experts=cfg.moe_experts, top_k=cfg.moe_top_k,
                   capacity_factor=cfg.moe_capacity_factor, ffn=cfg.ffn, activation=cfg.activation,
                   bias=cfg.bias, dropout=cfg.dropout, routing=routing(cfg), choice_bias=cfg.moe_choice_bias,
                   shared_d_ff=cfg.moe_shared_experts * (cfg.moe_d_ff or cfg.d_ff), router_bias=cfg.moe_router_bias)
    return FFNS.get(cfg.ffn)(cfg.d_model, cfg.d_ff, activation=cfg.activation, bias=cfg.bias,
                             dropout=cfg.dropout)


def sublayer_norm_of(cfg: ModelConfig) -> nn.Module:
    """One norm per sublayer, or the (inner, outer) pair of a sandwich placement (qkv.nn.residual)."""
    return sublayer_norm(cfg.norm_placement, lambda: norm(cfg))


def layer_positions(cfg: ModelConfig, plans: tuple[LayerPlan, ...]) -> list[Positional | None]:
    """Each layer's own rotation (None: the model's encoding), one module for the layers that share one."""
    made: dict[tuple, Positional] = {}
    own = []
    for plan in plans:
        if not plan.own_positions:
            own.append(None)
            continue
        key = (plan.kind, plan.rope_theta)
        if key not in made:
            made[key] = (Positional() if plan.kind == "nope" else  # (a layer's own base: unscaled)
                         Rotary(head_dim=cfg.head_dim, rope_theta=plan.rope_theta, rope_dims=cfg.rope_dims))
        own.append(made[key])
    return own


def block(cfg: ModelConfig, cross: bool = False, plan: LayerPlan | None = None,
          own_positions: Positional | None = None) -> Block:
    return Block(attn=attention(cfg, plan=plan, own_positions=own_positions), ffn=ffn(cfg, plan), attn_norm=sublayer_norm_of(cfg), ffn_norm=sublayer_norm_of(cfg),
                 residual=RESIDUALS.get(cfg.norm_placement).apply, cross_attn=attention(cfg, cross=True) if cross else None,
                 cross_norm=sublayer_norm_of(cfg) if cross else None)


def final_norm(cfg: ModelConfig) -> nn.Module:
    """Pre-LN and sandwich stacks end with a norm (GPT-2's ln_f); Post-LN blocks already end in one."""
    return norm(cfg) if RESIDUALS.get(cfg.norm_placement).final_norm else nn.Identity()


def embedding(rows: int, dim: int) -> nn.Embedding:
    """nn.Embedding(rows, dim); on the meta device (a loader's model, whose weights come from a file) without
    torch's N(0, 1) draw, which there runs a Python reference that imports TorchDynamo (about 1 s)."""
    if torch.empty(0).is_meta:  # (inside `with torch.device("meta")`)
        return nn.Embedding(rows, dim, _weight=torch.empty(rows, dim))
    return nn.Embedding(rows, dim)


def decoder(cfg: ModelConfig) -> DecoderLM:
    tok_emb = embedding(cfg.vocab_size, cfg.d_model)
    lm_head = (SoftCapHead(cfg.d_model, cfg.vocab_size, cap=cfg.logit_softcap) if cfg.logit_softcap else
               nn.Linear(cfg.d_model, cfg.vocab_size, bias=False))
    if cfg.tie_embeddings:
        lm_head.weight = tok_emb.weight  # W_out = W_E (note 003: the vocabulary projection is shared)
    plans = layer_plans(cfg)  # what each layer is (qkv.plan)
    blocks = [block(cfg, plan=plan, own_positions=own) for plan, own in zip(plans, layer_positions(cfg, plans))]
    return DecoderLM(tok_emb=tok_emb, positional=positional(cfg), blocks=blocks, final_norm=final_norm(cfg),
                     lm_head=lm_head, dropout=cfg.dropout, max_seq_len=cfg.max_seq_len,
                     bigram_emb=embedding(cfg.bigram_vocab, cfg.d_model) if cfg.bigram_vocab else None,
                     embed_scale=cfg.embed_scale)


def embed_norm(cfg: ModelConfig) -> nn.Module | None:
    return norm(cfg) if cfg.embed_norm else None


def encoder_stack(cfg: ModelConfig, tok_emb: nn.Embedding) -> Encoder:
    """The bare encoder: bidirectional blocks (note 000 §7), token types when type_vocab_size > 0."""
    type_emb = embedding(cfg.type_vocab_size, cfg.d_model) if cfg.type_vocab_size else None
    return Encoder(tok_emb=tok_emb, positional=positional(cfg, causal=False),
                   blocks=[block(cfg) for _ in range(cfg.encoder_layers)], final_norm=final_norm(cfg),
                   dropout=cfg.dropout, type_emb=type_emb, embed_norm=embed_norm(cfg),
                   embed_scale=cfg.embed_scale)


def encoder(cfg: ModelConfig) -> nn.Module:
    return HEADS.get(cfg.head)(cfg, encoder_stack(cfg, embedding(cfg.vocab_size, cfg.d_model)))


@HEADS.register("none")
def bare_encoder(cfg: ModelConfig, stack: Encoder) -> Encoder:
    return stack  # model(input_ids, attention_mask=mask) -> hidden (B, T, D)


@HEADS.register("mlm")
def mlm_head(cfg: ModelConfig, stack: Encoder) -> EncoderMLM:
    decoder = nn.Linear(cfg.d_model, cfg.vocab_size, bias=True)  # BERT's output bias b_V, even when tied
    if cfg.tie_embeddings:
        decoder.weight = stack.tok_emb.weight  # W_V = W_E (note 003: the vocabulary matrix is shared)
    nn.init.zeros_(decoder.bias)  # the init schemes skip a tied module (its weight belongs to W_E)
    head = MLMHead(transform=nn.Linear(cfg.d_model, cfg.d_model, bias=cfg.bias),
                   activation=ACTIVATIONS.get(cfg.activation), norm=norm(cfg), decoder=decoder)
    return EncoderMLM(stack, head)


@HEADS.register("classifier")
def classifier_head(cfg: ModelConfig, stack: Encoder) -> EncoderClassifier:
    head = ClassifierHead(pool=POOLINGS.get(cfg.pooling), pooler=nn.Linear(cfg.d_model, cfg.d_model, bias=cfg.bias),
                          out_proj=nn.Linear(cfg.d_model, cfg.n_classes, bias=cfg.bias), dropout=cfg.dropout)
    return EncoderClassifier(stack, head)


def encoder_decoder(cfg: ModelConfig) -> EncoderDecoder:
    """Vaswani et al. §3.4: with tie_embeddings one W_E serves the source and target embeddings and the
    output projection."""
    tok_emb = embedding(cfg.vocab_size, cfg.d_model)
    src_emb = tok_emb if cfg.tie_embeddings else embedding(cfg.vocab_size, cfg.d_model)
    lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
    if cfg.tie_embeddings:
        lm_head.weight = tok_emb.weight
    return EncoderDecoder(tok_emb=tok_emb, encoder=encoder_stack(cfg, src_emb), positional=decoder_positional(cfg),
                          blocks=[block(cfg, cross=True) for _ in range(cfg.decoder_layers)],
                          final_norm=final_norm(cfg), lm_head=lm_head, dropout=cfg.dropout,
                          max_seq_len=cfg.max_seq_len, embed_norm=embed_norm(cfg), embed_scale=cfg.embed_scale)


ARCHITECTURES.register("decoder")(Architecture(
    build=decoder, classes=(DecoderLM,), objective="lm", prompt="continue", embeds=False))
ARCHITECTURES.register("encoder")(Architecture(
    build=encoder, classes=(Encoder, EncoderMLM, EncoderClassifier), objective="mlm", prompt=None, embeds=True))
ARCHITECTURES.register("encoder-decoder")(Architecture(
    build=encoder_decoder, classes=(EncoderDecoder,), objective="seq2seq", prompt="source", embeds=False))
