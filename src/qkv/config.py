"""Configuration: frozen, keyword-only dataclasses that flow one way (config -> builder -> modules).

`ModelConfig` says what the network is; `TrainConfig` how it is trained; `DataConfig` what it reads;
`ParallelConfig` how it is laid out over processes. `RunConfig` holds the four and is what a run dir
stores as config.json.

This module is a leaf: it imports nothing of qkv but the error type, its value rules (qkv.config_values: types,
parsing, bounds), the model fields' combination rules (qkv.config_rules) and the JSON reader (qkv.files).
`validate()` checks what the config
can check alone (types, ranges, combinations of fields); the variant names (norm, positional, attention,
schedule, ...) belong to the registries beside the code they name, which check them where they are used,
and `qkv.train.checks.check_run` checks every name and the chosen entries' facts once, before any work. Every
error names the field, the value and what is allowed.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from qkv import config_rules
from qkv.config_values import (MAX_VOCAB, _at_least, _finite_and_bounded, _no_unknown, _positive, choice,  # noqa: F401
                               coerce, field_types, parse_value)
from qkv.errors import QkvError
from qkv.files import read_json

PRECISIONS = ("auto", "fp32", "bf16", "fp16")  # train.precision: the autocast dtype (qkv.parallel.precision.autocast);
# auto: bf16 where the device multiplies it natively, else fp32 (qkv.hardware, qkv.parallel.precision.resolve)


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    arch: str = "decoder"  # decoder | encoder | encoder-decoder
    vocab_size: int = 256  # V
    d_model: int = 128  # D
    n_heads: int = 4  # H
    head_size: int = 0  # Dh where it is not D / H (Qwen3: 1,024 wide, 16 heads of 128); 0 means D / H
    n_kv_heads: int = 0  # Hkv; 0 means n_heads (MHA), 1 is MQA, in between GQA
    n_layers: int = 2  # L (decoder-only and encoder-only)
    n_encoder_layers: int = 0  # encoder-decoder; 0 means n_layers
    n_decoder_layers: int = 0  # encoder-decoder; 0 means n_layers
    d_ff: int = 512  # F
    max_seq_len: int = 256
    positional: str = "learned"
    rope_theta: float = 10000.0
    # RoPE's frequencies stretched for a longer context (qkv.rope_scaling, docs/derivations/rope-scaling.md):
    # none | linear | llama3 | yarn, by rope_factor s over the rope_original_context it was trained at
    rope_scaling: str = "none"
    rope_factor: float = 1.0
    rope_original_context: int = 0  # llama3, yarn: the context before scaling (Llama 3.1: 8,192)
    rope_low_freq_factor: float = 1.0  # llama3: wavelengths above original / low are divided by s
    rope_high_freq_factor: float = 4.0  # llama3: wavelengths below original / high are kept
    rope_beta_fast: float = 32.0  # yarn: rotations in the original context above which a pair is kept
    rope_beta_slow: float = 1.0  # yarn: ... below which it is interpolated (divided by s)
    # longrope (Phi-3 128k): each turned pair's divisor of theta_i, the short set while a forward's positions stay
    # within rope_original_context and the long set past it (as transformers switches), cos and sin times
    # rope_attention_factor
    rope_long_factors: tuple[float, ...] = ()
    rope_short_factors: tuple[float, ...] = ()
    rope_attention_factor: float = 1.0
    rope_yarn_mscale: float = 0.0  # yarn: cos and sin times this where set (DeepSeek: 1); 0 means 0.1 ln s + 1
    rope_yarn_truncate: bool = True  # yarn: the ramp's ends rounded out to whole pairs (gpt-oss: not)
    rope_local_theta: float = 0.0  # the RoPE base of sliding layers, unscaled (Gemma 3: 10,000); 0: as global
    # dimensions of a head RoPE turns, the first rope_dims / 2 pairs of qkv's layout (the rest pass through
    # unturned: Phi-4-mini's partial_rotary_factor 0.75, GPT-NeoX's rotary_pct); 0 means all of head_dim
    rope_dims: int = 0
    # one entry per decoder layer (qkv.plan): global | sliding (the last sliding_window keys) | nope
    # (global, no rotation: SmolLM3); () means every layer global
    layer_types: tuple[str, ...] = ()
    sliding_window: int = 0  # keys a sliding layer sees, itself included (Mistral 4,096; Gemma 3 270M 512)
    query_scale: float = 0.0  # scores q.k / sqrt(query_scale) (Gemma's query_pre_attn_scalar); 0 means Dh
    attn_softcap: float = 0.0  # c > 0: scores c tanh(s / c) before the mask and softmax (Gemma 2); 0 = none
    attn_sinks: bool = False  # a learnt logit per head in each softmax's denominator, no value (gpt-oss)
    max_distance: int = 16  # relative positions: clip distance (Shaw) / bucket range (T5)
    t5_buckets: int = 32  # T5's relative_attention_num_buckets (half for each direction in an encoder)
    norm: str = "layernorm"
    norm_eps: float = 1e-5
    norm_placement: str = "pre"
    activation: str = "gelu"
    ffn: str = "mlp"  # mlp | glu
    moe_experts: int = 0  # E; 0 means a dense FFN
    moe_top_k: int = 2
    moe_capacity_factor: float = 0.0  # 0 means no capacity limit
    # how each family routes (qkv.nn.moe, docs/derivations/moe.md): scores softmax | sigmoid over all E
    # router logits; the top k chosen (by the scores plus moe_choice_bias where set, within the moe_group_top_k
    # best of moe_groups groups where set); their gates the chosen scores, renormalised to sum 1 when
    # moe_norm_topk, times moe_scale. Mixtral: softmax + norm (softmax over the top-k logits, note 002's gate);
    # OLMoE: softmax, not renormalised; DeepSeek-V2: softmax, groups, scale; DeepSeek-V3: sigmoid, bias, groups
    moe_scoring: str = "softmax"
    moe_norm_topk: bool = True
    moe_scale: float = 1.0
    moe_groups: int = 0  # G > 1: experts in G groups of E / G, tokens routed within the moe_group_top_k best
    moe_group_top_k: int = 0
    moe_choice_bias: bool = False  # a per-expert bias b_e added to the scores to choose, never to the gates
    moe_d_ff: int = 0  # an expert's hidden width; 0 means d_ff (DeepSeek, Qwen3-MoE: narrower than a dense layer)
    moe_shared_experts: int = 0  # S > 0: one FFN of S * moe_d_ff every token passes through beside its experts
    moe_dense_layers: tuple[int, ...] = ()  # layers (from 0) whose FFN is dense (d_ff) in an MoE model
    moe_router_bias: bool = False  # the router's logits get a learnt bias (gpt-oss)
    attention: str = "sdpa"
    # multi-head latent attention (DeepSeek-V2/V3; qkv.nn.mla) where mla_kv_rank r > 0: keys and values from one
    # r-wide latent a token, the position from one shared RoPE key mla_rope_dims wide (head_size = its nope dims +
    # those), queries through a mla_q_rank-wide latent (0: a full projection), values mla_v_dims wide (0: head_dim)
    mla_kv_rank: int = 0
    mla_q_rank: int = 0
    mla_rope_dims: int = 0
    mla_v_dims: int = 0
    qk_norm: bool = False  # RMS-normalise each head's q and k (learnt gain, before RoPE): Dehghani et al. 2023
    qk_norm_whole: bool = False  # ... over all heads' features of q and of k at once (OLMo 2, OLMoE)
    logit_softcap: float = 0.0  # c > 0: a decoder's logits c tanh(z / c) (Gemma 2, Team et al. 2024); 0 = none
    bigram_vocab: int = 0  # N > 0: a decoder's hashed bigram embedding, N rows (modded-nanogpt); 0 = none
    window: int = 0  # local / dilated / random kernels
    dropout: float = 0.0
    tie_embeddings: bool = True
    bias: bool = True
    init: str = "gpt2"
    init_std: float = 0.02
    # encoder and encoder-decoder families (note 003; docs/DEVIATIONS.md "Model families")
    head: str = "none"  # encoder only: none (hidden states) | mlm | classifier
    type_vocab_size: int = 0  # encoder only: token-type (segment) embeddings, 0 = none (BERT: 2)
    n_classes: int = 0  # head = classifier: number of classes
    pooling: str = "first"  # head = classifier: first | mean (over unpadded tokens)
    embed_norm: bool = False  # norm the summed embeddings (BERT); encoder / encoder-decoder only
    embed_scale: bool = False  # token embeddings * sqrt(D) (Vaswani et al. §3.4; Gemma's decoders)
    labels: tuple[str, ...] = ()  # head = classifier: the class names, index = class id (HF's id2label)

    @property
    def head_dim(self) -> int:  # Dh
        return self.head_size or self.d_model // self.n_heads

    @property
    def kv_heads(self) -> int:  # Hkv
        return self.n_kv_heads or self.n_heads

    @property
    def encoder_layers(self) -> int:
        return self.n_encoder_layers or self.n_layers

    @property
    def decoder_layers(self) -> int:
        return self.n_decoder_layers or self.n_layers

    def validate(self) -> "ModelConfig":
        """Sizes, ranges and combinations; the names are checked by qkv.models.build.check_model."""
        _finite_and_bounded("model", self)  # types too: also for a config built in code (an imported HF config)
        for name in ("vocab_size", "d_model", "n_heads", "n_layers", "d_ff", "max_seq_len"):
            _positive(f"model.{name}", getattr(self, name))
        for name in ("n_kv_heads", "n_encoder_layers", "n_decoder_layers", "moe_experts", "window", "head_size",
                     "sliding_window", "rope_original_context"):
            _at_least(f"model.{name}", getattr(self, name), 0)
        if not self.head_size and self.d_model % self.n_heads:
            raise QkvError(f"model.d_model={self.d_model} must be divisible by model.n_heads={self.n_heads} "
                           "(or set model.head_size)")
        if self.n_heads % self.kv_heads:
            raise QkvError(f"model.n_kv_heads={self.n_kv_heads} must divide model.n_heads={self.n_heads}")
        if self.moe_experts and not 1 <= self.moe_top_k <= self.moe_experts:
            raise QkvError(f"model.moe_top_k={self.moe_top_k} must be in 1..model.moe_experts={self.moe_experts}")
        config_rules.experts(self)
        config_rules.latent(self)
        if self.qk_norm_whole and not self.qk_norm:
            raise QkvError("model.qk_norm_whole=true needs model.qk_norm=true")
        if not 0.0 <= self.dropout < 1.0:
            raise QkvError(f"model.dropout={self.dropout} must be in [0, 1)")
        _positive("model.norm_eps", self.norm_eps)
        _positive("model.init_std", self.init_std)
        _positive("model.rope_theta", self.rope_theta)  # the base of the angles: <= 0 gives inf/NaN
        _positive("model.max_distance", self.max_distance)
        _at_least("model.t5_buckets", self.t5_buckets, 2)
        _at_least("model.moe_capacity_factor", self.moe_capacity_factor, 0)
        _at_least("model.logit_softcap", self.logit_softcap, 0)
        for name in ("attn_softcap", "query_scale", "rope_local_theta", "rope_yarn_mscale"):
            _at_least(f"model.{name}", getattr(self, name), 0)
        _positive("model.rope_factor", self.rope_factor)
        if self.rope_dims and (self.rope_dims % 2 or not 2 <= self.rope_dims <= self.head_dim):
            raise QkvError(f"model.rope_dims={self.rope_dims} must be an even number in 2..head_dim={self.head_dim} "
                           "(or 0: all)")
        turned = (self.rope_dims or self.head_dim) // 2
        if self.rope_scaling == "longrope" and not len(self.rope_long_factors) == len(self.rope_short_factors) == turned:
            raise QkvError(f"model.rope_long_factors / rope_short_factors have {len(self.rope_long_factors)} / "
                           f"{len(self.rope_short_factors)} entries: longrope needs one a turned pair, {turned}")
        if self.rope_dims not in (0, self.head_dim) and self.rope_scaling == "yarn":
            raise QkvError("model.rope_dims with rope_scaling=yarn: YaRN's factor on the turned pairs alone is not "
                           "supported by qkv")
        config_rules.layers(self)
        if self.bigram_vocab < 0 or self.bigram_vocab == 1:
            raise QkvError(f"model.bigram_vocab={self.bigram_vocab} must be 0 (none) or at least 2 rows")
        config_rules.family(self)
        return self


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    seed: int = 1337
    batch_size: int = 16  # global batch, sequences per optimizer step
    seq_len: int = 128
    max_steps: int = 1000  # the total, also after a resume
    max_time: float = 0.0  # seconds of training; 0 means no limit
    lr: float = 1e-3  # peak learning rate
    min_lr: float = 1e-4  # floor of the decaying schedules
    schedule: str = "cosine"
    warmup_steps: int = 100
    optimizer: str = "adamw"  # adamw | adam | sgd | muon (Muon on the hidden matrices, AdamW on the rest)
    muon_lr: float = 0.02  # optimizer muon: the hidden matrices' peak rate (train.lr stays the AdamW groups')
    muon_momentum: float = 0.95
    muon_iteration: str = "jordan"  # optimizer muon: the Newton-Schulz coefficients, jordan | polar_express
    decay_fraction: float = 0.3  # schedule wsd: the share of the run spent decaying to min_lr
    decay_shape: str = "linear"  # schedule wsd: the cooldown's shape, linear | sqrt (Hägele et al. 2024)
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0  # global L2 norm; 0 disables
    accumulation: int = 1  # micro-batches per optimizer step
    label_smoothing: float = 0.0
    aux_loss_weight: float = 0.01  # MoE load-balancing loss weight
    router_z_loss_weight: float = 0.0  # MoE router z-loss weight (ST-MoE: mean_n (logsumexp_e l_ne)^2); 0 = none
    moe_bias_rate: float = 0.0  # gamma > 0: DeepSeek-V3's auxiliary-loss-free balancing, each step
    # b_e += gamma sign(mean load - load_e) on the experts' choosing bias (model.moe_choice_bias)
    precision: str = "fp32"
    activation_checkpointing: bool = False
    checkpoint_every: int = 0  # steps; 0 means only at the end
    eval_every: int = 0  # steps; 0 means only at the end
    eval_batches: int = 16
    log_every: int = 10
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    threads: int = 0  # torch intra-op threads; 0 leaves torch's default
    peak_flops: float = 0.0  # hardware peak FLOP/s for MFU; 0: looked up for known GPUs, none on CPU
    time_horizon: bool = True  # with max_time, fit the LR schedule to the steps the time allows
    objective: str = "auto"  # auto (from model.arch) | lm | mlm | seq2seq (qkv.train.objectives)
    mask_prob: float = 0.15  # objective mlm: share of tokens predicted (BERT: 80% [MASK], 10% random, 10% kept)
    init: str = ""  # a run (qkv or HF dir) whose weights, all but the head, start this one (qkv.train.finetune)
    dpo_beta: float = 0.1  # objective dpo: beta of r = beta (log pi - log pi_ref) (qkv.train.dpo)
    lora: str = ""  # LoRA over the frozen model (qkv.nn.lora): "r=16,alpha=32,dropout=0.05,targets=q,k,v"; "" off
    # batch size (note 000 LLM §10.2; qkv.schedules): rows ramp linearly from batch_warmup_start to
    # batch_size over batch_warmup_steps (0: off); lr_scaling multiplies the LR by rows / base_batch (linear)
    batch_warmup_steps: int = 0
    batch_warmup_start: int = 1
    # sequence length (Li et al. 2022's sequence-length warmup; qkv.schedules): each step's first
    # cols(step) columns, seq_warmup_start, 2 x seq_warmup_start, ... up to seq_len over seq_warmup_steps (0: off)
    seq_warmup_steps: int = 0
    seq_warmup_start: int = 64
    lr_scaling: str = "none"  # none | linear | sqrt
    base_batch: int = 0  # the batch train.lr was tuned for; 0 means batch_size
    # robustness (docs/training.md)
    max_bad_steps: int = 10  # consecutive skipped (non-finite) steps before the run stops
    spike_factor: float = 3.0  # a loss above spike_factor x the running median is reported; 0 disables
    spike_window: int = 50  # losses in the running median
    loss_scale_window: int = 2000  # fp16: good steps in a row before the loss scale doubles
    tensorboard: bool = False  # also write TensorBoard event files (needs the tensorboard package)

    def validate(self) -> "TrainConfig":
        """Sizes and ranges; the names are checked by qkv.train.checks.check_run."""
        for name in ("batch_size", "seq_len", "max_steps", "accumulation", "eval_batches", "log_every",
                     "max_bad_steps", "spike_window", "loss_scale_window"):
            _positive(f"train.{name}", getattr(self, name))
        for name in ("peak_flops", "max_time", "warmup_steps", "checkpoint_every", "eval_every", "threads", "weight_decay",
                     "grad_clip", "min_lr", "aux_loss_weight", "router_z_loss_weight", "moe_bias_rate",
                     "batch_warmup_steps", "seq_warmup_steps", "base_batch",
                     "spike_factor"):
            _at_least(f"train.{name}", getattr(self, name), 0)
        for name in ("lr", "eps", "muon_lr", "dpo_beta"):
            _positive(f"train.{name}", getattr(self, name))
        if not 0.0 < self.decay_fraction <= 1.0:
            raise QkvError(f"train.decay_fraction={self.decay_fraction} must be in (0, 1]")
        for name in ("beta1", "beta2", "muon_momentum"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise QkvError(f"train.{name}={getattr(self, name)} must be in [0, 1)")
        if not 0.0 <= self.label_smoothing < 1.0:
            raise QkvError(f"train.label_smoothing={self.label_smoothing} must be in [0, 1)")
        if self.batch_size % self.accumulation:
            raise QkvError(f"train.accumulation={self.accumulation} must divide train.batch_size={self.batch_size}")
        choice("train.precision", self.precision, PRECISIONS)
        if not 1 <= self.batch_warmup_start <= self.batch_size:
            raise QkvError(f"train.batch_warmup_start={self.batch_warmup_start} must be in 1..train.batch_size="
                           f"{self.batch_size}")
        if self.seq_warmup_steps and not (1 <= self.seq_warmup_start <= self.seq_len
                                          and self.seq_len % self.seq_warmup_start == 0):
            raise QkvError(f"train.seq_warmup_start={self.seq_warmup_start} must divide train.seq_len={self.seq_len}: "
                           "the ramp's lengths are its multiples")
        if 0 < self.spike_factor <= 1:
            raise QkvError(f"train.spike_factor={self.spike_factor} must be above 1 (or 0 to disable)")
        if not 0.0 < self.mask_prob < 1.0:
            raise QkvError(f"train.mask_prob={self.mask_prob} must be in (0, 1)")
        return self


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    paths: tuple[str, ...] = ()  # empty: the bundled corpus
    corpus: str = "shakespeare"  # the bundled corpus used when paths is empty
    spelling: str = "modern"  # modern | first-folio (bundled corpus only)
    vocab_size: int = 2048  # BPE vocabulary to train; the model's V comes from the trained tokenizer
    val_fraction: float = 0.1  # user corpora: held-out share (whole documents where there are several)
    seq2seq_task: str = "next-line"  # objective seq2seq: next-line | reverse | folio (qkv.data.seq2seq.SEQ2SEQ_TASKS)
    # bundled corpus: standard (corpus.VALIDATION_WORKS) | genre (qkv.data.genres) | folio (qkv.data.folio)
    split: str = "standard"

    def validate(self) -> "DataConfig":
        _positive("data.vocab_size", self.vocab_size)
        if self.vocab_size < 257:
            raise QkvError(f"data.vocab_size={self.vocab_size} must be at least 257 (256 bytes + end of text)")
        if self.vocab_size > MAX_VOCAB:  # the tokenizer's trainer aborts the process far beyond it
            raise QkvError(f"data.vocab_size={self.vocab_size} is above {MAX_VOCAB:,} (2^20), more merges than "
                           "any text here can teach")
        if not 0.0 < self.val_fraction < 1.0:
            raise QkvError(f"data.val_fraction={self.val_fraction} must be in (0, 1)")
        return self


@dataclass(frozen=True, kw_only=True)
class ParallelConfig:
    dp: int = 1
    tp: int = 1
    pp: int = 1
    zero: int = 0
    ep: int = 1  # expert parallel: each MoE layer's experts split over ep of the dp ranks (qkv.parallel.experts)
    schedule: str = "1f1b"  # pp > 1: gpipe | 1f1b (qkv.parallel.pipeline)
    microbatches: int = 4  # pp > 1: micro-batches per batch, at least pp

    def validate(self) -> "ParallelConfig":
        for name in ("dp", "tp", "pp", "ep", "microbatches"):
            _positive(f"parallel.{name}", getattr(self, name))
        choice("parallel.zero", self.zero, (0, 1, 2, 3))
        return self


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)

    def validate(self) -> "RunConfig":
        for name in SECTIONS:
            _finite_and_bounded(name, getattr(self, name))
            getattr(self, name).validate()
        return self

    def to_dict(self) -> dict[str, Any]:
        return {name: dataclasses.asdict(getattr(self, name)) for name in SECTIONS}

    @classmethod
    def from_dict(cls, raw: Any, origin: str = "config") -> "RunConfig":
        if not isinstance(raw, dict):
            raise QkvError(f"{origin}: expected a JSON object with sections {', '.join(SECTIONS)}")
        _no_unknown(origin, raw, SECTIONS)
        return cls(**{name: section_from_dict(name, raw.get(name, {}), origin) for name in SECTIONS})

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def load(cls, path: Path) -> "RunConfig":
        return cls.from_dict(read_json(path), str(path))

    def override(self, assignments: list[str]) -> "RunConfig":
        """Apply `section.field=value` strings, each parsed to the field's type."""
        cfg = self
        for assignment in assignments:
            key, sep, text = assignment.partition("=")
            section, dot, name = key.strip().partition(".")
            if not sep or not dot:
                raise QkvError(f"--set {assignment!r}: expected section.field=value, e.g. model.d_model=256")
            _no_unknown("--set", {section: None}, SECTIONS)
            current = getattr(cfg, section)
            _no_unknown(f"--set {section}", {name: None}, [f.name for f in fields(current)])
            value = parse_value(f"{section}.{name}", text.strip(), field_types(type(current))[name])
            cfg = replace(cfg, **{section: replace(current, **{name: value})})
        return cfg


def merge_file(cfg: RunConfig, path: Path) -> RunConfig:
    """cfg with the sections of a --config JSON file laid over it (fields it does not name stay cfg's)."""
    raw = read_json(path)
    if not isinstance(raw, dict):
        raise QkvError(f"{path}: expected a JSON object with sections model, train, data, parallel")
    merged = cfg.to_dict()
    for section, values in raw.items():
        if section not in merged:
            raise QkvError(f"{path}: unknown section {section!r}; choose from: {', '.join(merged)}")
        if not isinstance(values, dict):
            raise QkvError(f"{path}: section {section!r} must be a JSON object")
        merged[section].update(values)
    return RunConfig(**{name: section_from_dict(name, merged[name], str(path)) for name in merged})


SECTIONS = {"model": ModelConfig, "train": TrainConfig, "data": DataConfig, "parallel": ParallelConfig}


def section_from_dict(name: str, raw: Any, origin: str = "config"):
    cls = SECTIONS[name]
    if not isinstance(raw, dict):
        raise QkvError(f"{origin}: section {name!r} must be a JSON object")
    types = field_types(cls)
    _no_unknown(f"{origin}: {name}", raw, list(types))
    return cls(**{key: coerce(f"{name}.{key}", value, types[key]) for key, value in raw.items()})
