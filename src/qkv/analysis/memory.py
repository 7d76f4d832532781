"""Training and inference memory from a ModelConfig (note 000 LLM §5.3, §6.2, §7.3, §8.1; SPEC F1, claims 23-24).

Model states, bytes per parameter (P parameters, tied weights once):
                                  weights  gradients  fp32 master  optimizer (Adam m and v in fp32)
    fp32                             4         4           -            8           = 16
    bf16 / fp16, qkv (autocast)      4         4           -            8           = 16   (the fp32 weights are
                                                                                         the master copy)
    bf16 / fp16, textbook            2         2           4            8           = 16   (Micikevicius et al.
                                                                                         2018: layout="textbook")
qkv trains with fp32 weights and gradients and runs the matmuls in bf16 / fp16 under autocast, so its own
layout is the default; the textbook one is what the notes' analysis (and claims 23-24) assume.
Note 000 LLM §8.1 counts "Adam 175B x 2 x 2 bytes": fp16 moments and no master copy, half of the truth
(claim 23). SGD with momentum keeps one fp32 state (4 bytes), no optimizer state at all without momentum.
ZeRO (Rajbhandari et al. 2020; note 000 LLM §7.3) over N data-parallel GPUs divides by N: stage 1 the
optimizer states and master weights, stage 2 also the gradients, stage 3 also the weights (qkv's FSDP2
keeps its root unit, everything outside the blocks, gathered through the step: `root_params`).
Tensor parallel over t ranks (qkv.parallel.tensor) splits the blocks' projections and the
vocabulary-parallel W_E / head by t and replicates norms and positional tables; pipeline parallel over p
stages (qkv.parallel.pipeline) gives each rank its layers, the first stage the embedding, the last the final
norm and the head (W_E again when tied). The figures are those of the most loaded rank.

Activations are the tensors autograd keeps for the backward pass of qkv's layers (qkv.nn), per layer
for B sequences of T tokens, in elements (a = activation bytes; softmax probabilities stay fp32; under
qkv's bf16 / fp16 autocast the residual stream x and the norms stay fp32, the matmuls' inputs and outputs
are 2 bytes, and each multiplied matrix has a 2-byte copy kept for the backward):
    attention block   x, LN(x), Q, K, V (K, V repeated to H heads for GQA), concat(heads), + the
                      kernel's own: out and logsumexp (fused sdpa) or A = softmax(QK^T) (B H T S, naive)
                      (on a CPU, under autocast, the fused sdpa attends in fp32: it keeps fp32 copies of Q,
                      K, V and of its output, qkv.nn.kernels.sdpa; Setup.device)
    FFN block         x, LN(x), act input and output (mlp: 2 B T F; glu: gate, act(gate), up, product 4 B T F)
    dropout masks     1 byte per element where dropout > 0
The LM head keeps LN(x); qkv's training step runs the head and its loss in row chunks (under autocast too,
the products in low precision, the head's matrix copied for the step only), which keep dloss/dH (B T D) and
dloss/dW (V D) only; otherwise (chunked_head=False, tensor parallel, a pipeline) the loss keeps its fp32
log-probabilities (B T V) and their gradient. The peak comes in the last layer's backward, so its
score gradients count too (dA, dS for a kernel that keeps A; one tile's for flash).
A score bias adds what its positional's hooks keep (`hook_saves`: indices, q-dependent rows) and, for a
kernel that keeps no A, the dense (B, H, T, S) bias; a learned one its gradient at the peak (`hook_backward`).
With activation checkpointing (LLM §6.2) only each layer's input survives the forward; one layer's
activations are rebuilt at a time in the backward.
Per rank (`activations`): tensor parallel with sequence parallel keeps T/tp stream positions, H/tp heads
and F/tp hidden units (LN(x) gathered whole; the logits V/tp wide, whole in a pipeline); pipeline stage s
keeps its layers for the micro-batches in flight (IN_FLIGHT). Measured against each rank's peak: docs/distributed.md.
Expert parallel (ep ranks) holds E / ep of the routed experts per rank, whole (ZeRO shards the rest over dp).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from qkv.analysis import params
from qkv.config import ModelConfig
from qkv.errors import QkvError
from qkv.analysis.flops import score_pairs
from qkv.plan import cached_columns, layer_plans
from qkv.nn.kernels import KERNELS
from qkv.nn.linear_cross_entropy import chunk_rows
from qkv.nn.positional import POSITIONALS

PRECISION_BYTES = {  # weights, gradients, master weights, activations: qkv's layout (fp32 under autocast)
    "fp32": (4, 4, 0, 4),
    "bf16": (4, 4, 0, 2),
    "fp16": (4, 4, 0, 2),
}
TEXTBOOK_BYTES = {**PRECISION_BYTES, "bf16": (2, 2, 4, 2), "fp16": (2, 2, 4, 2)}  # low-precision weights + master
LAYOUTS = {"qkv": PRECISION_BYTES, "textbook": TEXTBOOK_BYTES}
OPTIMIZER_BYTES = {"adamw": 8, "adam": 8, "sgd": 4, "muon": 8}  # fp32 states per parameter (muon: at most; its matrices keep 4)
FP32 = 4
# pipeline schedule -> (m micro-batches, p stages, stage s) -> the micro-batches whose activations stage s
# holds at once: every one under GPipe (all forwards before any backward), p - s under 1F1B (its warm-up
# forwards), at most m (Narayanan et al. 2021, §2.2)
IN_FLIGHT = {"gpipe": lambda m, p, s: m, "1f1b": lambda m, p, s: min(p - s, m)}


@dataclass(frozen=True)
class Setup:
    """How a model is trained: the calculator's inputs besides the ModelConfig."""

    batch: int = 1  # sequences per GPU per micro-batch
    seq: int = 0  # tokens per sequence; 0 means max_seq_len
    precision: str = "fp32"
    optimizer: str = "adamw"
    zero: int = 0
    gpus: int = 1  # data-parallel ranks (ZeRO shards over them)
    checkpointing: bool = False
    tp: int = 1
    pp: int = 1
    ep: int = 1  # expert-parallel ranks: each holds E / ep of every MoE layer's experts, unsharded by ZeRO
    layout: str = "qkv"  # or "textbook": low-precision weights and gradients beside an fp32 master copy
    chunked_head: bool = True  # the LM head and its loss in row chunks, as qkv's training step runs them
    split_logits: bool = True  # tp > 1: the loss on V/tp logits per rank (label smoothing gathers them whole)
    microbatches: int = 1  # pp > 1: the pipeline's micro-batches per schedule (batch is one micro-batch)
    accumulation: int = 1  # micro-batches (or schedules) accumulated per optimizer step: MFU's tokens only
    schedule: str = "1f1b"  # pp > 1: gpipe | 1f1b
    device: str = "cuda"  # or "cpu", where the fused sdpa keeps fp32 Q, K, V and output under autocast

    @property
    def bytes(self) -> tuple[int, int, int, int]:
        """(weights, gradients, master weights, activations) bytes per element."""
        return LAYOUTS[self.layout][self.precision]

    def check(self) -> "Setup":
        for name, allowed in (("precision", PRECISION_BYTES), ("device", ("cuda", "cpu")), ("optimizer", OPTIMIZER_BYTES),
                              ("zero", (0, 1, 2, 3)), ("layout", LAYOUTS), ("schedule", IN_FLIGHT)):
            if getattr(self, name) not in allowed:
                raise QkvError(f"{name}={getattr(self, name)!r} is not allowed; choose from: "
                               f"{', '.join(map(str, allowed))}")
        for name in ("batch", "gpus", "tp", "pp", "ep", "microbatches", "accumulation"):
            if getattr(self, name) <= 0:
                raise QkvError(f"{name}={getattr(self, name)} must be positive")
        if self.seq < 0:
            raise QkvError(f"seq={self.seq} must be positive")
        return self


def model_states(n_params: float, setup: Setup, gathered: float = 0) -> dict[str, float]:
    """Bytes per GPU of weights, gradients, master weights and optimizer states of `n_params` parameters
    under ZeRO; `gathered` of them held whole under ZeRO-3 (FSDP2's root unit, `root_params`)."""
    weight, grad, master, _ = setup.bytes
    shard = lambda stage: setup.gpus if setup.zero >= stage else 1  # noqa: E731
    kept = gathered if setup.zero == 3 else 0
    return {"weights": ((n_params - kept) / shard(3) + kept) * weight, "gradients": n_params * grad / shard(2),
            "master_weights": n_params * master / shard(1),
            "optimizer_states": n_params * OPTIMIZER_BYTES[setup.optimizer] / shard(1)}


def rank_params(cfg: ModelConfig, setup: Setup) -> float:
    """Parameters held by the most loaded rank of the tp x pp grid (before ZeRO's sharding over dp)."""
    parts = params.breakdown(cfg)
    if cfg.arch != "decoder" or (setup.tp == 1 and setup.pp == 1):
        return parts["total"]
    t = setup.tp
    split = {"attention": parts["attention"] / t, "ffn": parts["ffn"] / t, "embedding": parts["embedding"] / t,
             "lm_head": parts["lm_head"] / t}  # row-parallel biases are replicated: counted split (D per layer)
    layer = (split["attention"] + split["ffn"] + parts["norms"]) / cfg.n_layers
    embed = split["embedding"] + (parts["positional"] if cfg.positional == "learned" else 0)
    shared = 0 if cfg.positional == "learned" else parts["positional"]  # every layer reads it: every stage
    head = parts["final_norm"] + split["lm_head"] + parts.get("embed_norm", 0)
    stages = params.stage_layers(cfg.n_layers, setup.pp)
    return max(len(layers) * layer + shared + (embed if s == 0 else 0)
               + (head + (split["embedding"] if cfg.tie_embeddings and s > 0 else 0) if s == len(stages) - 1 else 0)
               for s, layers in enumerate(stages))


def running_kernel(cfg: ModelConfig) -> str:
    """The kernel that runs: sdpa hands a value term (Shaw) to the naive kernel."""
    spec = KERNELS.get(cfg.attention)
    if POSITIONALS.get(cfg.positional).value_term and spec.value_term_kernel:
        return spec.value_term_kernel
    return cfg.attention


def kernel_spec(cfg: ModelConfig):
    return KERNELS.get(running_kernel(cfg))


def root_params(cfg: ModelConfig, setup: Setup) -> float:
    """Parameters outside the blocks (embeddings, final norm, head; a pipeline stage's own, the larger of
    the first's and the last's): FSDP2's root unit (qkv.parallel.layout.shard_fully), which stays gathered
    from the forward into the backward under ZeRO-3 (the head and the loss run on the model's output)."""
    parts = params.breakdown(cfg)
    blocks = sum(n for name, n in parts.items() if name.split(".")[-1] in ("attention", "cross_attention", "ffn", "norms"))
    outside = parts["total"] - blocks
    if setup.pp > 1 and cfg.arch == "decoder":
        first = parts["embedding"] + (parts["positional"] if cfg.positional == "learned" else 0)
        outside = max(first, outside - first + (parts["embedding"] if cfg.tie_embeddings else 0))
    return outside / (setup.tp if cfg.arch == "decoder" else 1)


def kernel_saves(cfg: ModelConfig, T: int, S: int) -> tuple[int, int]:
    """(probabilities, copied Dh-wide rows) the attention kernel saves per head for its backward (its registry
    entry): the scores it computes when it keeps them (else none: a flash-style kernel keeps one log-sum-exp
    per row), and its gathered or regrouped copies of q, k, v."""
    spec = kernel_spec(cfg)
    probabilities = score_pairs(running_kernel(cfg), T, S, cfg.window) if spec.keeps_probabilities else 0
    return probabilities, 0 if spec.copied_rows is None else spec.copied_rows(T, S, cfg.window)


def score_bias_bytes(cfg: ModelConfig, B: int, T: int, S: int, a: int, self_attention: bool) -> float:
    """What the positional's score and value hooks keep in one attention sub-layer (its `hook_saves`), and
    the dense (B, H, T, S) bias a kernel that keeps no probabilities saves for its backward (measured:
    exactly that for sdpa and flash; a kernel that keeps A needs no bias in its backward). The bias is
    fp32 when made from positions (ALiBi) or a table (T5), in q's precision when made from q (Shaw, XL).
    Cross-attention has no positional hooks."""
    positional = POSITIONALS.get(cfg.positional)
    if not self_attention or positional.score_bias_kind is None:
        return 0
    spec, H = kernel_spec(cfg), cfg.n_heads
    hooks = positional.hook_saves(B, H, T, S, a=a, head_dim=cfg.head_dim, max_distance=cfg.max_distance,
                                  value_buckets=spec.keeps_value_buckets)
    dense = spec.score_pairs is None and not spec.keeps_probabilities
    element = a if positional.score_bias_kind == "content" else FP32
    return hooks + (element * B * H * T * S if dense else 0)


def _attention_layer(cfg: ModelConfig, B: int, T: int, S: int, a: int, stream: int, self_attention: bool = True,
                     t: int = 1, wide: bool = False) -> float:
    """Bytes one attention sub-layer keeps (self-attention: S = T); `stream`: bytes of the residual stream.
    Over t tensor-parallel ranks (sequence parallel): x holds T/t positions, LN(x) is gathered whole for
    the column-split projections, each rank keeps H/t heads. `wide`: the kernel attends a-byte Q, K, V in
    fp32 (sdpa on a CPU) and keeps those and its fp32 output beside the a-byte concat(heads)."""
    D, H, Dh = cfg.d_model, cfg.n_heads // t, cfg.head_dim
    kv = 2 * B * S * H * Dh  # K, V as the kernel reads them: repeated to H heads for GQA / MQA
    elements = B * T * D + B * T * H * Dh + kv + B * T * H * Dh  # LN(x), Q, K+V, concat(heads); + x below
    probabilities, copied = kernel_saves(cfg, T, S)
    if not probabilities:
        kernel = FP32 * B * H * T  # logsumexp; its output, laid out (B, T, H, Dh), is concat(heads)
    else:
        kernel = FP32 * B * H * probabilities  # A = softmax(Q K^T / sqrt(Dh)) where computed, fp32
    kernel += score_bias_bytes(cfg, B, T, S, a, self_attention) / t
    masks = (B * T * D / t + B * H * probabilities) if cfg.dropout else 0
    if wide and not probabilities:
        kernel += (FP32 - a) * (B * T * H * Dh + kv) + FP32 * B * T * H * Dh
    return stream * B * T * D / t + a * (elements + B * H * Dh * copied) + kernel + masks


def _ffn_layer(cfg: ModelConfig, B: int, T: int, a: int, stream: int, t: int = 1, moe: bool | None = None) -> float:
    """`moe`: the layer routes (qkv.plan; default: whether the model has experts)."""
    moe = bool(cfg.moe_experts) if moe is None else moe
    D, F = cfg.d_model, (cfg.moe_d_ff or cfg.d_ff if moe else cfg.d_ff) // t
    hidden = (4 if cfg.ffn == "glu" else 2) * B * T * F
    if moe:  # each token's hidden activations exist once per chosen expert and shared expert, + router
        hidden = hidden * (cfg.moe_top_k + cfg.moe_shared_experts) + B * T * cfg.moe_experts * (a + FP32)
    masks = B * T * D / t if cfg.dropout else 0
    return stream * B * T * D / t + a * (B * T * D + hidden) + masks  # x, LN(x) (gathered), the hidden units


def layer_activations(cfg: ModelConfig, B: int, T: int, a: int, source: int = 0, stream: int | None = None,
                      t: int = 1, wide: bool = False, moe: bool | None = None) -> float:
    """One layer's saved activations (on one of t tensor-parallel ranks); a decoder layer of an
    encoder-decoder adds cross-attention. `moe`: its FFN routes (default: whether the model has experts)."""
    stream = a if stream is None else stream
    total = _attention_layer(cfg, B, T, T, a, stream, t=t, wide=wide) + _ffn_layer(cfg, B, T, a, stream, t, moe)
    return total + (_attention_layer(cfg, B, T, source, a, stream, self_attention=False, wide=wide) if source else 0)


def _layers(cfg: ModelConfig, T: int) -> list[tuple[int, int, bool]]:
    """(T, source length, whether its FFN routes) per layer, encoder layers first."""
    moe = bool(cfg.moe_experts)
    if cfg.arch == "encoder":
        return [(T, 0, moe)] * cfg.encoder_layers
    if cfg.arch == "encoder-decoder":
        return [(T, 0, moe)] * cfg.encoder_layers + [(T, T, moe)] * cfg.decoder_layers
    return [(T, 0, routes) for routes in params.routed_layers(cfg, cfg.decoder_layers, True)]


def head_activations(cfg: ModelConfig, B: int, T: int, a: int, autocast: bool = False,
                     chunked: bool = False, t: int = 1, vocab_split: int = 1) -> float:
    """Final norm input and output, the fp32 log-probabilities and their gradient (B, T, V); under autocast
    also the low-precision logits. `chunked`: the training step's head-and-loss in row chunks
    (qkv.nn.linear_cross_entropy; `chunks_head`): no (B, T, V) survives the forward, which keeps dloss/dH
    (B, T, D) and dloss/dW (V, D) in fp32 instead. Under t tensor-parallel ranks the norm's input holds
    T/t positions and each rank's logits are V / vocab_split wide: t with the vocabulary-parallel loss, 1 in
    a pipeline (whole logits for the last stage's loss); never chunked."""
    if cfg.arch == "encoder" and cfg.head == "none":
        return a * B * T * cfg.d_model
    D, V = cfg.d_model, cfg.vocab_size / vocab_split
    if chunked:
        return a * 2 * B * T * D + FP32 * (B * T * D + V * D)
    logits = a * B * T * V if autocast else 0
    return a * (1 + 1 / t) * B * T * D + 2 * FP32 * B * T * V + logits


def chunks_head(cfg: ModelConfig, setup: Setup) -> bool:
    """Whether the training step takes the head and its loss in row chunks (qkv.nn.head_cross_entropy): a
    decoder's plain fp32 head, in fp32 or under bf16 autocast; not under fp16, not tensor parallel's DTensor
    head nor the pipeline's loss on whole logits."""
    return (setup.chunked_head and cfg.arch == "decoder" and setup.tp == 1 and setup.pp == 1
            and setup.precision != "fp16")


def head_chunk(cfg: ModelConfig, B: int, T: int, chunked: bool, autocast: bool = False, a: int = FP32) -> float:
    """The chunked head-and-loss's one chunk of fp32 logits (C x V, C = chunk_rows(V)), alive in the forward
    beside everything saved; under autocast also the chunk's low-precision product and the head's matrix
    in low precision (a bytes); none when the head is not chunked."""
    if not chunked:
        return 0
    rows = min(B * T, chunk_rows(cfg.vocab_size))
    low = a * (rows * cfg.vocab_size + cfg.vocab_size * cfg.d_model) if autocast else 0
    return FP32 * rows * cfg.vocab_size + low


def attention_backward(cfg: ModelConfig, B: int, T: int, a: int) -> float:
    """The fp32 score gradients the last layer's attention backward forms while everything saved is still
    alive: its kernel's `backward_scores` per head (dA and dS for a kernel that keeps A; one tile's P, dP,
    dS for flash; none counted for sdpa, the sparse and the linear kernels); a score bias with parameters
    adds its gradient (B, H, T, S) where the kernel keeps no A (whose dS it is) and what the positional's
    `hook_backward` forms from it."""
    spec, H = kernel_spec(cfg), cfg.n_heads
    scores = 0 if spec.backward_scores is None else FP32 * B * H * spec.backward_scores(T, T)
    positional = POSITIONALS.get(cfg.positional)
    if positional.score_bias_kind not in ("learned", "content"):
        return scores
    a = FP32 if positional.score_bias_kind == "learned" else a
    gradient = a * B * H * T * T if spec.score_pairs is None and not spec.keeps_probabilities else 0
    return scores + gradient + positional.hook_backward(B, H, T, T, a=a, max_distance=cfg.max_distance)


def layer_backward(cfg: ModelConfig, B: int, T: int, a: int, t: int = 1) -> float:
    """The activation gradients the last layer's FFN backward holds at once, beside everything saved: of
    its activation's output and input (four hidden-sized ones for a GLU) and of its input, on one of t
    tensor-parallel ranks (the peak when no kernel's score gradients are larger)."""
    hidden = (4 if cfg.ffn == "glu" else 2) * cfg.d_ff / t
    return a * B * T * (hidden + cfg.d_model)


def weight_copies(cfg: ModelConfig, a: int, chunked: bool = False) -> float:
    """Autocast's low-precision copies of the matrices the forward multiplies, kept for the backward's
    dx = dy W^T: the blocks' projections and the head (W_E when tied), whose copy the chunked head-and-loss
    holds only while it runs (head_chunk)."""
    parts = params.breakdown(cfg)
    matrices = sum(n for name, n in parts.items() if name.endswith(("attention", "ffn")))
    return a * (matrices + (0 if chunked else cfg.vocab_size * cfg.d_model))


def activations(cfg: ModelConfig, setup: Setup) -> dict[str, float]:
    """Bytes of the most loaded rank at the step's peak: one micro-batch of setup.batch sequences, its
    layers split over tp ranks and pp stages (decoders; each stage holding `in_flight` micro-batches)."""
    B, T = setup.batch, setup.seq or cfg.max_seq_len
    a = setup.bytes[3]
    # qkv's autocast: the residual stream and the norms stay fp32, the matmuls' inputs and outputs are
    # low precision, and each multiplied matrix gets a low-precision copy (weight_copies)
    autocast = setup.layout == "qkv" and setup.precision != "fp32"
    stream = FP32 if autocast else a
    decoder = cfg.arch == "decoder"
    t, p = (setup.tp, setup.pp) if decoder else (1, 1)
    chunked = chunks_head(cfg, setup)
    wide = autocast and setup.device == "cpu" and running_kernel(cfg) == "sdpa"  # qkv.nn.kernels.sdpa
    per_layer = [layer_activations(cfg, B, length, a, source, stream, t, wide, moe)
                 for length, source, moe in _layers(cfg, T)]
    split = t if p == 1 and setup.split_logits else 1  # a pipeline's last stage and label smoothing: whole logits
    head = head_activations(cfg, B, T, a, autocast, chunked, t, vocab_split=split)
    copies = weight_copies(cfg, a, chunked) / t if autocast else 0
    transient = max(head_chunk(cfg, B, T, chunked, autocast, a), attention_backward(cfg, B, T, a) / t,
                    layer_backward(cfg, B, T, a, t))
    if setup.checkpointing:
        # layer inputs kept; the head's backward finishes before the first layer is rebuilt (with the
        # gradient flowing into it), so the peak is the larger of the two on top of the inputs
        inputs = a * B * T * cfg.d_model / t
        return {"activations": inputs * len(per_layer) + max(head, max(per_layer) + inputs) + copies}
    # everything saved is alive at the head's last chunk and in the last layer's backward (with its score
    # gradients): the peak is the larger
    if p == 1:
        return {"activations": sum(per_layer) + head + copies + transient}
    return {"activations": max(stage_activations(cfg, setup, per_layer[0], head, transient, autocast))}


def stage_activations(cfg: ModelConfig, setup: Setup, layer: float, head: float, transient: float,
                      autocast: bool) -> list[float]:
    """Each pipeline stage's peak: its layers' (and the last stage's head's) activations for the
    micro-batches it holds at once, + the backward's transient and autocast's copies of its own matrices
    (W_E on both ends); the last stage also holds what its loss keeps beyond the head's saved tensors: the
    stage output the schedule keeps until the backward and the loss backward's second (B, T, V) gradient."""
    in_flight, p, a = IN_FLIGHT[setup.schedule], setup.pp, setup.bytes[3]
    T, V, D = setup.seq or cfg.max_seq_len, cfg.vocab_size, cfg.d_model
    ends = a * V * D if autocast else 0
    per_layer_copies = (weight_copies(cfg, a) - ends) / cfg.n_layers if autocast else 0
    logits = 2 * FP32 * setup.batch * T * V
    peaks = []
    for s, layers in enumerate(params.stage_layers(cfg.n_layers, p)):
        last = s == p - 1
        held = in_flight(setup.microbatches, p, s) * (len(layers) * layer + (head if last else 0))
        copies = len(layers) * per_layer_copies + (ends if s in (0, p - 1) else 0)
        peaks.append(held + transient + copies + (logits if last else 0))
    return peaks


def training(cfg: ModelConfig, setup: Setup) -> dict[str, float]:
    """{part: bytes per GPU} and the total, for one training step's peak."""
    setup.check()
    routed = params.routed_experts(cfg) if setup.ep > 1 else 0  # expert parallel (qkv.parallel.experts)
    held = model_states(rank_params(cfg, setup) - routed, setup, root_params(cfg, setup))
    own = model_states(routed / setup.ep, dataclasses.replace(setup, zero=0))  # its experts, whole
    parts = {**{part: held[part] + own[part] for part in held}, **activations(cfg, setup)}
    return {**parts, "total": sum(parts.values())}


def kv_cache(cfg: ModelConfig, *, batch: int, seq: int, bytes_per_element: int = 2, source_seq: int = 0) -> int:
    """Inference KV cache: K and V of every decoder layer, 2 B T Hkv Dh elements a layer (GQA/MQA shrink Hkv),
    T the layer's columns: all seq tokens for a global layer, a sliding layer's ring of W + RING_SPARE slots
    at any length (qkv.plan, qkv.nn.cache: generate, chat and serve keep them so); an encoder-decoder also
    caches the cross-attention K, V over the S source tokens. Latent attention (qkv.nn.mla) caches r + d_R
    elements a token a layer: the latent and the shared RoPE key, whatever its head count."""
    if cfg.arch == "encoder":
        return 0
    per_column = 2 * cfg.kv_heads * cfg.head_dim * bytes_per_element  # one token's K and V in one layer
    if cfg.mla_kv_rank:
        per_column = (cfg.mla_kv_rank + cfg.mla_rope_dims) * bytes_per_element
    if cfg.arch == "decoder" and cfg.layer_types:
        columns = sum(cached_columns(plan, seq) for plan in layer_plans(cfg))
        return per_column * batch * columns
    per_token = per_column * cfg.decoder_layers
    cross = per_token * batch * (source_seq or seq) if cfg.arch == "encoder-decoder" else 0
    return per_token * batch * seq + cross
