"""Multi-head latent attention (DeepSeek-V2, DeepSeek-AI 2024 §2.1; DeepSeek-V3), derived in
docs/derivations/mla.md beside note 000 §2.2's attention and note 003's RoPE.

Keys and values of every head come from one compressed latent per token, and the position from one decoupled
RoPE key that all heads share:

    c_t = RMSNorm(x_t W_DKV^T)                       the latent, r = model.mla_kv_rank wide (512 in V3)
    k_t^R = RoPE(x_t W_KR^T)                         the shared rotated key, d_R = model.mla_rope_dims (64)
    k_t,h = [W_UK,h c_t ; k_t^R]   v_t,h = W_UV,h c_t    per head: d_N = Dh - d_R dims from c, then k^R
    q_t = c'_t W_UQ^T (c'_t = RMSNorm(x_t W_DQ^T), q rank model.mla_q_rank; or x_t W_Q^T)
    q_t,h = [q_t,h^N ; RoPE(q_t,h^R)]
    o_t,h = sum_j softmax_j(q_t,h . k_j,h / sqrt(Dh)) v_j,h;    y_t = [o_t,1 ... o_t,H] W_O^T

W_DKV and W_KR are one matrix (kv_a_proj: r + d_R rows), W_UK and W_UV one (kv_b_proj: H (d_N + d_V) rows), as
the checkpoints keep them. The point of MLA is its cache: only c_t and k_t^R, r + d_R numbers a token a layer
(576 in V3, against 2 H Dh = 32,768 for MHA of its width). A call with a KV cache (generation) computes the way the
paper decodes, with W_UK absorbed into the query and W_UV applied after the weights:

    q_t,h . k_j,h = (W_UK,h^T q_t,h^N) . c_j + q_t,h^R . k_j^R     =  [W_UK,h^T q^N ; q^R] . [c_j ; k_j^R]
    o_t,h = W_UV,h sum_j a_tj,h c_j

so attention runs over one shared key head of [c ; k^R] (r + d_R wide) whose first r columns are the values
(multi-query attention over the latent), the cache holds exactly that key, and the per-head keys and values are
never formed. A call without a cache (training, scoring a text) forms them, as the paper trains: its scores cost
H (Dh + d_V) a pair instead of H (2r + d_R) (3.4x fewer at V3's sizes). The scores' scale stays Dh^-1/2 (times
YaRN's mscale^2 where the checkpoint sets it: model.query_scale). Hook points as Attention's, in the form the call
takes: per head q, k (B, H, T, Dh) and v (B, H, T, d_V) without a cache; with one the absorbed queries
(B, H, T, r + d_R), the latent keys (B, 1, S, r + d_R) and values (B, 1, S, r); scores / pattern (formed when
hooked); z (B, H, T, d_V); out.
"""
from __future__ import annotations

import torch
from torch import Tensor, nn

from qkv.nn.cache import LayerCache
from qkv.nn.hookpoints import point, wants
from qkv.nn.kernels import kernel_for, weighted_values, weights_for
from qkv.nn.norms import RMSNorm


class LatentAttention(nn.Module):
    hook_points = ("q", "k", "v", "scores", "pattern", "z", "out")  # qkv.nn.hookpoints

    def __init__(self, d_model: int, n_heads: int, *, kv_rank: int, q_rank: int, head_dim: int, rope_dims: int,
                 v_dim: int, norm_eps: float, kernel: str = "sdpa", bias: bool = False, dropout: float = 0.0,
                 scale: float = 0.0):
        super().__init__()
        self.n_heads, self.kv_rank, self.rope_dims, self.v_dim = n_heads, kv_rank, rope_dims, v_dim
        self.qk_dim, self.nope = head_dim, head_dim - rope_dims  # Dh = d_N + d_R
        self.n_kv_heads, self.head_dim = 1, kv_rank + rope_dims  # the one cached key head [c ; k^R]
        self.sliding, self.softcap, self.window, self.kernel_name = 0, 0.0, 0, kernel
        self.kernel = kernel_for(kernel)
        self.scale = scale or head_dim ** -0.5
        if q_rank:
            self.q_a_proj = nn.Linear(d_model, q_rank, bias=bias)  # W_DQ (r_q, D)
            self.q_a_norm = RMSNorm(q_rank, eps=norm_eps)
            self.q_b_proj = nn.Linear(q_rank, n_heads * head_dim, bias=False)  # W_UQ (H Dh, r_q)
        else:
            self.q_proj = nn.Linear(d_model, n_heads * head_dim, bias=False)  # W_Q (H Dh, D)
        self.kv_a_proj = nn.Linear(d_model, kv_rank + rope_dims, bias=bias)  # [W_DKV ; W_KR] (r + d_R, D)
        self.kv_a_norm = RMSNorm(kv_rank, eps=norm_eps)
        self.kv_b_proj = nn.Linear(kv_rank, n_heads * (self.nope + v_dim), bias=False)  # [W_UK,h ; W_UV,h] per head
        self.o_proj = nn.Linear(n_heads * v_dim, d_model, bias=bias)  # W_O (D, H d_V)
        self.positional = None  # (the model's rotation, on the d_R dims: qkv.models.build)
        self.attn_dropout = dropout
        self.dropout = nn.Dropout(dropout) if dropout else nn.Identity()

    @property
    def cache_dims(self) -> tuple[int, int, int]:
        """(key heads, key width, value width) of its KV cache: one head of [c ; k^R]; no values of its own."""
        return 1, self.kv_rank + self.rope_dims, 0

    def queries(self, x: Tensor) -> Tensor:
        """q (B, H, T, Dh) before the rotation."""
        B, T, _ = x.shape
        q = self.q_b_proj(self.q_a_norm(self.q_a_proj(x))) if hasattr(self, "q_b_proj") else self.q_proj(x)
        return q.view(B, T, self.n_heads, self.qk_dim).transpose(1, 2)

    def up(self) -> tuple[Tensor, Tensor]:
        """(W_UK (H, d_N, r), W_UV (H, d_V, r)) from kv_b_proj's rows, head by head."""
        w = self.kv_b_proj.weight.view(self.n_heads, self.nope + self.v_dim, self.kv_rank)
        return w[:, :self.nope], w[:, self.nope:]

    def forward(self, x: Tensor, ctx, cache: LayerCache | None = None, memory: Tensor | None = None) -> Tensor:
        B, T, _ = x.shape
        q_nope, q_rope = self.queries(x).split((self.nope, self.rope_dims), dim=-1)
        latent, k_rope = self.kv_a_proj(x).split((self.kv_rank, self.rope_dims), dim=-1)
        latent = self.kv_a_norm(latent)[:, None]  # c (B, 1, T, r)
        q_rope, k_rope = ctx.positional.rotate(q_rope, k_rope[:, None], ctx.positions)  # (B, H | 1, T, d_R)
        k_rope = k_rope.to(latent.dtype)
        if cache is None:  # a whole sequence (training, scoring): each head's keys and values, cheaper here
            z = self.per_head(q_nope, q_rope, latent, k_rope, ctx)
        else:  # from and into the latent cache (generation): W_UK absorbed, W_UV after the weights
            z = self.absorbed(q_nope, q_rope, latent, k_rope, ctx, cache)
        z = point(self, "z", z)  # (B, H, T, d_V)
        return self.dropout(point(self, "out", self.o_proj(z.transpose(1, 2).reshape(B, T, -1))))

    def per_head(self, q_nope: Tensor, q_rope: Tensor, latent: Tensor, k_rope: Tensor, ctx) -> Tensor:
        """The paper's training form: k_h = [W_UK,h c ; k^R], v_h = W_UV,h c for every head."""
        B, H, T, _ = q_nope.shape
        up = self.kv_b_proj(latent[:, 0]).view(B, T, H, self.nope + self.v_dim).transpose(1, 2)
        k_nope, v = up.split((self.nope, self.v_dim), dim=-1)
        q = point(self, "q", torch.cat((q_nope, q_rope), dim=-1))  # (B, H, T, Dh)
        k = point(self, "k", torch.cat((k_nope, k_rope.expand(B, H, T, self.rope_dims)), dim=-1))
        return self.attend(q, k, point(self, "v", v), ctx)  # (B, H, T, d_V)

    def absorbed(self, q_nope: Tensor, q_rope: Tensor, latent: Tensor, k_rope: Tensor, ctx, cache: LayerCache) -> Tensor:
        """Decoding's form: multi-query attention of [W_UK,h^T q^N ; q^R] over the cached [c ; k^R]."""
        B, H = q_nope.shape[:2]
        w_uk, w_uv = self.up()
        q = point(self, "q", torch.cat((torch.einsum("bhtn,hnr->bhtr", q_nope, w_uk), q_rope), dim=-1))
        k = point(self, "k", torch.cat((latent, k_rope), dim=-1))  # (B, 1, T, r + d_R)
        k, _ = cache.append(k, k[..., :0])  # (B, 1, S, r + d_R): the latent cache
        k = k if k.dtype == q.dtype else k.to(q.dtype)
        v = point(self, "v", k[..., :self.kv_rank])  # the values are the latents (B, 1, S, r)
        out = self.attend(q, k.expand(B, H, *k.shape[2:]), v.expand(B, H, *v.shape[2:]), ctx)  # (B, H, T, r)
        return torch.einsum("bhtr,hvr->bhtv", out, w_uv)  # W_UV,h sum_j a_j c_j

    def attend(self, q: Tensor, k: Tensor, v: Tensor, ctx) -> Tensor:
        dropout = self.attn_dropout if self.training else 0.0
        if wants(self, "scores") or wants(self, "pattern"):
            weights = weights_for(self.kernel_name)
            pattern = weights(q, k, mask=ctx.mask, causal=ctx.causal, bias=None, scale=self.scale,
                              on_scores=lambda scores: point(self, "scores", scores))
            return weighted_values(point(self, "pattern", pattern), v, None, dropout)
        return self.kernel(q, k, v, mask=ctx.mask, causal=ctx.causal, bias=None, scale=self.scale, dropout=dropout)

    def extra_repr(self) -> str:
        return (f"heads={self.n_heads}, kv_rank={self.kv_rank}, rope_dims={self.rope_dims}, qk_dim={self.qk_dim}, "
                f"v_dim={self.v_dim}")
