"""Flash attention in training: the exact softmax attention of note 002 ("Flash Attention": tiling, online
softmax, recomputation; Dao et al. 2022, Algorithms 1-2), with a hand-written backward.

Forward: sweep the key tiles (`BLOCK` keys each) keeping, per query row, a running max m, a running sum
l = sum exp(s - m) and an unnormalised output acc = sum exp(s - m) v; a tile that raises the max rescales
both by exp(m_old - m_new); out = acc / l. Only out and the row log-sum-exp L = m + log l ((B, H, T, 1))
are saved for the backward, besides the inputs: O(n) extra memory, however long the sequence.
Backward (the same derivation as qkv.ref.flash, 000 LLM §3.3.3 tile by tile): recompute each tile's
P = exp(S - L), then

    dV_j += P~^T dO_i     dP = dO_i V_j^T     dS = P * (dP - D_i)     D = rowsum(dO * O)
    dQ_i += dS K_j * scale     dK_j += dS^T Q_i * scale     dbias_ij = dS_ij (a learnt bias only)

where P~ is P after dropout (P * M / (1 - p), M the keep mask, replayed from a generator seeded in the
forward, so no mask is stored). Shaw's value term out_i += sum_j P~_ij table[index_ij] is linear in P~: each
tile adds its buckets, the gather of dO table^T joins dP, and dtable sums the buckets against dO; D still
equals rowsum(dO * O) because O includes the value term.

`pattern` restricts the keys further (the dilated and random kernels of qkv.nn.sparse use it); tiles that
nothing may see are skipped, forward and backward. A learnt score bias (T5, Shaw, Transformer-XL) is a dense
(B, H, T, S) input, so its gradient is one too: O(n^2) exists then because the bias does, not because of
the kernel.
"""
from __future__ import annotations

import collections
from typing import Callable, Iterator

import torch
from torch import Tensor

from qkv.nn.kernels import KERNELS, KernelSpec, RelativeValues, attention_weights, wide_dtype

BLOCK = 128  # key tile: O(T * BLOCK) working memory for a fixed tile
Pattern = Callable[[Tensor, Tensor], Tensor]  # (query columns (r,), key columns (c,)) -> allowed (r, c)


def tile(x: Tensor, T: int, S: int, rows: slice, cols: slice) -> Tensor:
    """The (rows, cols) tile of a tensor broadcastable to (.., T, S), without expanding it in memory."""
    return x.expand(*x.shape[:-2], T, S)[..., rows, cols]


def tile_allowed(query_cols: Tensor, key_cols: Tensor, *, mask: Tensor | None, causal: bool,
                 pattern: Pattern | None) -> Tensor | None:
    """Mask, causal triangle and pattern of one tile combined, or None when everything is allowed."""
    allowed = mask
    if mask is None and causal:
        allowed = key_cols[None, :] <= query_cols[:, None]  # (r, c)
    if pattern is not None:
        seen = pattern(query_cols, key_cols)
        allowed = seen if allowed is None else allowed & seen
    return allowed


def key_tiles(T: int, S: int, block: int, *, mask: Tensor | None, causal: bool, pattern: Pattern | None,
              device) -> Iterator[tuple[slice, slice, Tensor | None]]:
    """(query rows, key columns, allowed) of every tile with something to see, in a fixed order. Queries
    are the last T of S columns: under the plain causal triangle, queries before a tile's first key see none
    of it and are left out of its rows."""
    query_cols = torch.arange(S - T, S, device=device)  # (T,)
    for start in range(0, S, block):
        cols = slice(start, min(start + block, S))
        first = max(0, start - (S - T)) if causal and mask is None else 0
        if first >= T:
            break
        rows = slice(first, T)
        allowed = tile_allowed(query_cols[rows], torch.arange(cols.start, cols.stop, device=device),
                               mask=None if mask is None else tile(mask, T, S, rows, cols), causal=causal,
                               pattern=pattern)
        if allowed is not None and not bool(allowed.any()):
            continue
        yield rows, cols, allowed


class Tiles:
    """Everything both passes need to form a tile's scores and its dropout mask."""

    def __init__(self, q, k, *, mask, causal, bias, scale, pattern, block, dropout, seed):
        self.q, self.k, self.mask, self.causal, self.bias = q, k, mask, causal, bias
        self.scale, self.pattern, self.block, self.dropout, self.seed = scale, pattern, block, dropout, seed
        self.T, self.S = q.shape[-2], k.shape[-2]

    def __iter__(self):
        return key_tiles(self.T, self.S, self.block, mask=self.mask, causal=self.causal, pattern=self.pattern,
                         device=self.q.device)

    def scores(self, rows: slice, cols: slice, allowed: Tensor | None) -> Tensor:
        """S = Q_i K_j^T * scale (+ bias), -inf where not allowed. (B, H, r, c) in the wide dtype."""
        s = (self.q[:, :, rows] @ self.k[:, :, cols].transpose(-2, -1)) * self.scale
        if self.bias is not None:
            s = s + tile(self.bias, self.T, self.S, rows, cols)
        return s if allowed is None else s.masked_fill(~allowed, float("-inf"))

    def generator(self) -> torch.Generator | None:
        """The dropout masks' generator: the same seed draws the same masks in the backward."""
        return None if not self.dropout else torch.Generator(device=self.q.device).manual_seed(self.seed)

    def keep(self, p: Tensor, generator: torch.Generator | None) -> Tensor | None:
        """M / (1 - dropout) for the tile, M ~ Bernoulli(1 - dropout), so that P~ = P * keep; None without
        dropout. Drawn in tile order, so the same generator gives the backward the forward's masks."""
        if generator is None:
            return None
        kept = torch.rand(p.shape, generator=generator, device=p.device, dtype=p.dtype) >= self.dropout
        return kept / (1.0 - self.dropout)


def value_tile(value_bias: RelativeValues, T: int, S: int, rows: slice, cols: slice) -> Tensor:
    return tile(value_bias.index, T, S, rows, cols)[:, None]  # (B, 1, r, c)


def flash_forward(tiles: Tiles, v: Tensor, value_bias: RelativeValues | None) -> tuple[Tensor, Tensor]:
    """The online softmax over the key tiles. Returns out (B, H, T, Dh) and L = logsumexp (B, H, T, 1)."""
    q, (B, H, T, _) = tiles.q, tiles.q.shape
    m = q.new_full((B, H, T, 1), float("-inf"))
    l = q.new_zeros((B, H, T, 1))
    acc = q.new_zeros((B, H, T, v.shape[-1]))
    buckets = None if value_bias is None else q.new_zeros((B, H, T, value_bias.table.shape[0]))
    generator = tiles.generator()
    for rows, cols, allowed in tiles:
        s = tiles.scores(rows, cols, allowed)  # (B, H, r, c)
        m_new = torch.maximum(m[:, :, rows], s.amax(-1, keepdim=True))
        m_safe = m_new.masked_fill(m_new == float("-inf"), 0.0)  # rows that have seen nothing yet
        p = torch.exp(s - m_safe)
        correction = torch.exp(m[:, :, rows] - m_safe)  # exp(m_old - m_new)   (B, H, r, 1)
        keep = tiles.keep(p, generator)
        kept = p if keep is None else p * keep  # dropout of A = dropout of p; l keeps every p
        l[:, :, rows] = l[:, :, rows] * correction + p.sum(-1, keepdim=True)
        acc[:, :, rows] = acc[:, :, rows] * correction + kept @ v[:, :, cols]
        if buckets is not None:
            index = value_tile(value_bias, tiles.T, tiles.S, rows, cols)
            buckets[:, :, rows] = buckets[:, :, rows] * correction + value_bias.buckets(kept, index)
        m[:, :, rows] = m_new
    if buckets is not None:
        acc = acc + buckets @ value_bias.table
    return acc / l, m + torch.log(l)


class FlashAttention(torch.autograd.Function):
    """out = softmax(Q K^T * scale + bias + M) V (+ the value term), saving out and L only (module docstring)."""

    @staticmethod
    def forward(ctx, q, k, v, bias, table, index, mask, causal, scale, pattern, block, dropout, seed):
        with torch.autocast(q.device.type, enabled=False):  # the tiles in the wide dtype, as the backward
            return FlashAttention.run_forward(ctx, q, k, v, bias, table, index, mask, causal, scale, pattern,
                                              block, dropout, seed)

    @staticmethod
    def run_forward(ctx, q, k, v, bias, table, index, mask, causal, scale, pattern, block, dropout, seed):
        wide = wide_dtype(q.dtype)
        qw, kw, vw = q.to(wide), k.to(wide), v.to(wide)
        bw = None if bias is None else bias.to(wide)
        value_bias = None if table is None else RelativeValues(index, table.to(wide))
        tiles = Tiles(qw, kw, mask=mask, causal=causal, bias=bw, scale=scale, pattern=pattern, block=block,
                      dropout=dropout, seed=seed)
        out, lse = flash_forward(tiles, vw, value_bias)
        ctx.save_for_backward(q, k, v, bias, table, index, mask, out, lse)
        ctx.options = (causal, scale, pattern, block, dropout, seed)
        return out.to(v.dtype)

    @staticmethod
    def backward(ctx, dout):
        with torch.autocast(dout.device.type, enabled=False):  # recompute the tiles as the forward formed them
            return FlashAttention.run_backward(ctx, dout)

    @staticmethod
    def run_backward(ctx, dout):
        q, k, v, bias, table, index, mask, out, lse = ctx.saved_tensors
        causal, scale, pattern, block, dropout, seed = ctx.options
        wide = out.dtype
        qw, kw, vw, dout = q.to(wide), k.to(wide), v.to(wide), dout.to(wide)
        tiles = Tiles(qw, kw, mask=mask, causal=causal, bias=None if bias is None else bias.to(wide),
                      scale=scale, pattern=pattern, block=block, dropout=dropout, seed=seed)
        grads = flash_backward(tiles, vw, out, lse, dout, None if table is None else table.to(wide), index,
                               bias_shape=None if bias is None or not ctx.needs_input_grad[3] else bias.shape)
        dq, dk, dv, dbias, dtable = grads
        return (dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype),
                None if dbias is None else dbias.to(bias.dtype),
                None if dtable is None or not ctx.needs_input_grad[4] else dtable.to(table.dtype),
                None, None, None, None, None, None, None, None)


def flash_backward(tiles: Tiles, v: Tensor, out: Tensor, lse: Tensor, dout: Tensor, table: Tensor | None,
                   index: Tensor | None, *, bias_shape) -> tuple:
    """The tile recurrences of the module docstring. Returns (dq, dk, dv, dbias or None, dtable or None)."""
    q, k = tiles.q, tiles.k
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    dbias = None if bias_shape is None else q.new_zeros(bias_shape)
    value_bias = None if table is None else RelativeValues(index, table)
    dtable = None if table is None else torch.zeros_like(table)
    per_row = None if table is None else dout @ table.T  # dO_i . table_r   (B, H, T, R)
    rowdot = (dout * out).sum(-1, keepdim=True)  # D_i = rowsum(A * dA) = rowsum(dO * O)   (B, H, T, 1)
    generator = tiles.generator()
    for rows, cols, allowed in tiles:
        p = torch.exp(tiles.scores(rows, cols, allowed) - lse[:, :, rows])  # the recomputed A tile
        keep = tiles.keep(p, generator)  # the forward's mask, replayed
        kept = p if keep is None else p * keep
        do = dout[:, :, rows]
        dv[:, :, cols] += kept.transpose(-2, -1) @ do
        dp = do @ v[:, :, cols].transpose(-2, -1)  # dA~_ij = dO_i . v_j
        if value_bias is not None:  # + dO_i . table[index_ij]; dtable += buckets(P~)^T dO
            idx = value_tile(value_bias, tiles.T, tiles.S, rows, cols)
            dp = dp + torch.gather(per_row[:, :, rows], -1, idx.expand_as(p))
            dtable += torch.einsum("bhrn,bhrd->nd", value_bias.buckets(kept, idx), do)
        if keep is not None:
            dp = dp * keep  # through the mask: dA = M / (1 - p) * dA~
        ds = p * (dp - rowdot[:, :, rows])  # (B, H, r, c)
        dq[:, :, rows] += ds @ k[:, :, cols] * tiles.scale
        dk[:, :, cols] += ds.transpose(-2, -1) @ q[:, :, rows] * tiles.scale
        if dbias is not None:
            add_to_bias(dbias, ds, rows, cols)
    return dq, dk, dv, dbias, dtable


def add_to_bias(dbias: Tensor, ds: Tensor, rows: slice, cols: slice) -> None:
    """dbias += dS on the tile, summed over the leading dimensions the bias broadcasts (B or H of size 1).
    qkv's learnt biases are (.., T, S) in their last two dimensions."""
    dims = [d for d in range(ds.dim() - 2) if dbias.shape[d] == 1 and ds.shape[d] != 1]
    dbias[..., rows, cols] += ds.sum(dim=dims, keepdim=True) if dims else ds


def tiled(q: Tensor, k: Tensor, v: Tensor, *, mask: Tensor | None, causal: bool, bias: Tensor | None,
          scale: float, dropout: float = 0.0, value_bias: RelativeValues | None = None,
          pattern: Pattern | None = None, block: int | None = None) -> Tensor:
    """Exact softmax attention over key tiles: out and L saved for the backward, each tile recomputed there
    (module docstring). Without gradients (inference) nothing is saved at all."""
    block = block or BLOCK  # read at call time: tests shrink it to exercise many tiles
    seed = int(torch.randint(0, 2 ** 62, (1,))) if dropout else 0  # the global RNG decides the masks
    table, index = (None, None) if value_bias is None else (value_bias.table, value_bias.index)
    return FlashAttention.apply(q, k, v, bias, table, index, mask, causal, scale, pattern, block, dropout, seed)


# how many calls each path ran in this process: "tiled", or torch's fused "flash" / "efficient" CUDA kernels
BACKENDS_RUN: collections.Counter = collections.Counter()


def fused_backend(q: Tensor, k: Tensor, *, mask: Tensor | None, causal: bool, bias: Tensor | None,
                  value_bias: RelativeValues | None) -> str | None:
    """Which of torch's fused CUDA kernels computes this call exactly as the tiled kernel does, or None.

    Both keep out and the log-sum-exp only (O(n) memory, as the tiled kernel): "flash" (FlashAttention-2)
    for fp16 / bf16 on compute capability 8.0+ with head width <= 256, else "efficient" (the
    memory-efficient kernel, any float dtype). Neither takes a score bias, a value term or a padding mask
    here, and torch aligns `is_causal` top-left, so a causal call with cached keys (T < S, T > 1) stays tiled."""
    T, S, Dh = q.shape[-2], k.shape[-2], q.shape[-1]
    if q.device.type != "cuda" or bias is not None or value_bias is not None or mask is not None:
        return None
    if causal and T != S and T > 1:
        return None
    if q.dtype in (torch.float16, torch.bfloat16) and Dh <= 256 and Dh % 8 == 0 \
            and torch.cuda.get_device_capability(q.device) >= (8, 0):
        return "flash"
    return "efficient" if Dh % 8 == 0 else None


def flash(q: Tensor, k: Tensor, v: Tensor, *, mask: Tensor | None, causal: bool, bias: Tensor | None,
          scale: float, dropout: float = 0.0, value_bias: RelativeValues | None = None) -> Tensor:
    """Exact softmax attention in O(n) extra memory, forward and backward (note 002; SPEC claim 18): torch's
    fused flash / memory-efficient CUDA kernel where one applies (`fused_backend`), else the tiled kernel."""
    backend = fused_backend(q, k, mask=mask, causal=causal, bias=bias, value_bias=value_bias)
    BACKENDS_RUN[backend or "tiled"] += 1
    if backend is None:
        return tiled(q, k, v, mask=mask, causal=causal, bias=bias, scale=scale, dropout=dropout,
                     value_bias=value_bias)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    chosen = SDPBackend.FLASH_ATTENTION if backend == "flash" else SDPBackend.EFFICIENT_ATTENTION
    with sdpa_kernel([chosen]):  # that kernel or an error, never torch's O(n^2) math fallback
        return torch.nn.functional.scaled_dot_product_attention(
            q, k, v, dropout_p=dropout, is_causal=causal and q.shape[-2] > 1, scale=scale)  # K, V: H heads


def causal_pairs(T: int, S: int) -> int:
    """Scores flash computes under the causal triangle (`key_tiles`): each key tile of BLOCK columns from
    `start` meets only the queries from its first key on, T - (start - (S - T)) of them."""
    return sum(min(BLOCK, S - start) * (T - max(0, start - (S - T))) for start in range(0, S, BLOCK)
               if start - (S - T) < T)


# flash keeps out and L only; the calculator's model of it (qkv calc) counts no (T, S) probabilities
KERNELS.register("flash")(KernelSpec(fn=flash, weights=attention_weights, keeps_probabilities=False,
                                     keeps_value_buckets=False,
                                     causal_pairs=causal_pairs,
                                     backward_scores=lambda T, S: 3 * T * min(BLOCK, S)))  # one tile's P, dP, dS
