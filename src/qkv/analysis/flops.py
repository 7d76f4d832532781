"""FLOPs per component, forward and backward, from a ModelConfig (note 000 §9.3, §10, §19; LLM §5.3).

Unit: one FLOP per multiply and one per add, so a multiply-add is 2 FLOPs, as torch.utils.flop_counter
counts. The notes count multiply-adds ("complexity"): note 000 §10.1.4's attention cost
2n^2 d + 4 n d^2 per layer is (4 n^2 d + 8 n d^2) FLOPs here, and §9.3's FFN 8 n d^2 is 16 n d^2 FLOPs.
Only matrix products are counted (as the FLOP counter does): softmax, norms, activations and residual
additions are O(n d) and left out. The scores counted are those the kernel computes (its registry entry's
`score_pairs`: local's band, dilated's residue classes; under a causal mask `causal_pairs`: flash's tiles
skip the rows the triangle hides, about half); for the others the full T x S, as the naive and sdpa kernels
compute it.

Per layer, B sequences of T queries over S keys (S = T for self-attention), FLOPs forward:
    projections   2 B T D (H Dh) + 2 B S D (2 Hkv Dh) + 2 B T (H Dh) D       (W^Q; W^K, W^V; W^O)
    scores        2 B H T S Dh (Q K^T) + 2 B H T S Dh (A V)                   (note 000 §10.1.1-2)
    latent        projections 2 B T (D r_q + r_q H Dh + D (r + d_R) + r H (d_N + d_V) + H d_V D),
                  scores 2 B H T S Dh + 2 B H T S d_V (qkv.nn.mla's form without a cache)
    FFN           2 B T D F x 2 (mlp), x 3 (glu); MoE: top_k experts (moe_d_ff wide) + the shared experts
                  + router 2 B T D E; the plan's dense layers (model.moe_dense_layers) as a dense FFN
    LM head       2 B T D V
Backward = 2 x forward: every matmul y = x W needs dx = dy W^T and dW = x^T dy (LLM §3.2).
"""
from __future__ import annotations

from dataclasses import replace

from qkv.analysis import params
from qkv.config import ModelConfig
from qkv.errors import QkvError
from qkv.nn.kernels import KERNELS

MAC = 2  # FLOPs per multiply-add


def attention_projections(cfg: ModelConfig, tokens: int, source_tokens: int) -> int:
    if cfg.mla_kv_rank:  # latent attention as qkv.nn.mla computes a whole sequence: each head's k and v formed
        H, Dh, r, rq, d_r = cfg.n_heads, cfg.head_dim, cfg.mla_kv_rank, cfg.mla_q_rank, cfg.mla_rope_dims
        v_dim = cfg.mla_v_dims or Dh
        q = cfg.d_model * rq + rq * H * Dh if rq else cfg.d_model * H * Dh
        return MAC * tokens * (q + cfg.d_model * (r + d_r) + r * H * (Dh - d_r + v_dim) + H * v_dim * cfg.d_model)
    q_width, kv_width = cfg.n_heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
    return MAC * (tokens * cfg.d_model * q_width + source_tokens * cfg.d_model * 2 * kv_width
                  + tokens * q_width * cfg.d_model)


def attention_scores(cfg: ModelConfig, batch: int, T: int, S: int, causal: bool = False) -> int:
    """Q K^T and A V over every head; linear attention (note 000 §15.2) instead does phi(K)^T V and
    phi(Q) (phi(K)^T V), 2 x 2 B H T Dh^2, plus its normaliser."""
    H, Dh = cfg.n_heads, cfg.head_dim
    if cfg.mla_kv_rank:  # scores over Dh, values d_V wide
        pairs = score_pairs(cfg.attention, T, S, cfg.window, causal)
        return MAC * batch * H * pairs * (Dh + (cfg.mla_v_dims or Dh))
    if cfg.attention == "linear":
        return MAC * batch * H * (2 * S * Dh * Dh + T * Dh * Dh + T * Dh)
    return MAC * 2 * batch * H * score_pairs(cfg.attention, T, S, cfg.window, causal) * Dh


def score_pairs(kernel: str, T: int, S: int, window: int, causal: bool = False) -> int:
    """(query, key) scores per head that `kernel` computes for T queries over S keys (under the causal
    triangle when `causal`: a kernel that skips what it hides says how many it computes)."""
    spec = KERNELS.get(kernel)
    if causal and spec.causal_pairs is not None:
        return spec.causal_pairs(T, S)
    return T * S if spec.score_pairs is None else spec.score_pairs(T, S, window)


def ffn(cfg: ModelConfig, tokens: int, moe: bool | None = None) -> int:
    """An FFN's FLOPs are 2 x the weights a token uses (biases add, not multiply-add: not counted): k experts,
    the router and the shared experts of an MoE layer (`moe`, default: whether the model has experts)."""
    return MAC * tokens * params.active_ffn(replace(cfg, bias=False), moe)


def lm_head(cfg: ModelConfig, tokens: int) -> int:
    return MAC * tokens * cfg.d_model * cfg.vocab_size


def encoder_head(cfg: ModelConfig, batch: int, T: int) -> int:
    """BERT's heads: MLM transform D x D and vocabulary projection per token; classifier pooler D x D
    and class projection per sequence."""
    D = cfg.d_model
    per_token = {"none": 0, "mlm": D * D + D * cfg.vocab_size}.get(cfg.head)
    if per_token is not None:
        return MAC * batch * T * per_token
    return MAC * batch * (D * D + D * cfg.n_classes)


def _stack(cfg: ModelConfig, layers: int, batch: int, T: int, prefix: str, source: int = 0,
           causal: bool = False, decoder: bool = False) -> dict[str, int]:
    tokens = batch * T
    parts = {f"{prefix}attention_projections": layers * attention_projections(cfg, tokens, tokens),
             f"{prefix}attention_scores": layers * attention_scores(cfg, batch, T, T, causal)}
    if source:
        parts[f"{prefix}cross_attention_projections"] = layers * attention_projections(cfg, tokens, batch * source)
        parts[f"{prefix}cross_attention_scores"] = layers * attention_scores(cfg, batch, T, source)
    parts[f"{prefix}ffn"] = sum(ffn(cfg, tokens, moe) for moe in params.routed_layers(cfg, layers, decoder))
    return parts


def forward(cfg: ModelConfig, *, batch: int = 1, seq: int | None = None, source_seq: int | None = None) -> dict[str, int]:
    """{component: forward FLOPs} for `batch` sequences of `seq` tokens (default max_seq_len); an
    encoder-decoder reads `source_seq` source tokens (default seq)."""
    T = seq or cfg.max_seq_len
    S = source_seq or T
    if batch <= 0 or T <= 0 or S <= 0:
        raise QkvError(f"batch={batch} and seq={T} must be positive")
    if cfg.arch == "decoder":
        return {**_stack(cfg, cfg.decoder_layers, batch, T, "", causal=True, decoder=True),
                "lm_head": lm_head(cfg, batch * T)}
    if cfg.arch == "encoder":
        return {**_stack(cfg, cfg.encoder_layers, batch, T, ""), "head": encoder_head(cfg, batch, T)}
    return {**_stack(cfg, cfg.encoder_layers, batch, S, "encoder."),
            **_stack(cfg, cfg.decoder_layers, batch, T, "decoder.", source=S, causal=True),
            "lm_head": lm_head(cfg, batch * T)}


def table(cfg: ModelConfig, *, batch: int = 1, seq: int | None = None, source_seq: int | None = None) -> dict:
    """Forward, backward (2x) and training (3x) FLOPs per component and in total."""
    fwd = forward(cfg, batch=batch, seq=seq, source_seq=source_seq)
    rows = {name: {"forward": f, "backward": 2 * f, "train": 3 * f} for name, f in fwd.items()}
    total = sum(fwd.values())
    rows["total"] = {"forward": total, "backward": 2 * total, "train": 3 * total}
    return rows


def recomputed(cfg: ModelConfig, *, batch: int = 1, seq: int | None = None) -> int:
    """Extra FLOPs of activation checkpointing per layer: every layer's forward runs again in the backward
    (hardware FLOPs, not model FLOPs: MFU does not count them). An upper bound: torch's non-reentrant
    checkpoint stops once every saved tensor is rebuilt, so a Pre-LN block's last projection is skipped."""
    fwd = forward(cfg, batch=batch, seq=seq)
    return sum(f for name, f in fwd.items() if name not in ("lm_head", "head"))


def train_flops_per_token(cfg: ModelConfig, seq: int | None = None) -> float:
    """Forward + backward FLOPs per trained token, attention scores included (3 x forward)."""
    T = seq or cfg.max_seq_len
    return 3 * sum(forward(cfg, batch=1, seq=T).values()) / T


def six_nd(n_params: int, tokens: float) -> float:
    """C = 6 N D (Kaplan et al. 2020; note 000 LLM §8.1): 2 N forward + 4 N backward FLOPs per token."""
    return 6.0 * n_params * tokens


def mfu(cfg: ModelConfig, *, seq: int, tokens_per_s: float, peak_flops: float) -> float:
    """Model FLOPs utilisation: achieved model FLOPs per second / the hardware's peak (PaLM, App. B).
    Recomputation (activation checkpointing) is not counted: it is hardware work, not model work."""
    if peak_flops <= 0:
        raise QkvError(f"peak FLOP/s={peak_flops} must be positive")
    return train_flops_per_token(cfg, seq) * tokens_per_s / peak_flops


# dense bf16/fp16 tensor-core peaks (vendor data sheets, SXM parts, no sparsity), matched by device name
PEAK_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "V100": 125e12}


def peak_flops_for(device_name: str) -> float | None:
    """The bf16/fp16 dense peak FLOP/s of a known GPU (torch.cuda.get_device_name), else None."""
    return next((peak for key, peak in PEAK_FLOPS.items() if key in device_name.upper()), None)
