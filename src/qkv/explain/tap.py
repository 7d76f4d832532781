"""The recorder `qkv explain` runs the reference engine with (`with qkv.ref.block.tapped(Recorder()):`).

While tapped, every block the engine builds has its placement, norms, sublayers and attention kernel
wrapped by this recorder's. Each wrapper calls the engine's own function and keeps what went in and came
out, forward and backward, so every number `qkv explain` shows is one the reference engine computed in
its forward or its hand-derived backward (note 000 LLM §3), not a second implementation. Two small
extras are formed from the engine's pieces: the queries and keys before RoPE's rotation (the projection
again, for the positional step) and the FFN's hidden gradient and activation mask (the down projection's
backward and act' of the cached pre-activation), both with the engine's functions.

    recorder.blocks[i]["parts"]  # per block call, in forward order: [{"name": "attn" | "cross_attn" | "ffn",
                                 #   "stream_in", "stream_out", "norm" (or "norm_inner", "norm_outer"),
                                 #   "input", "output", kernel / FFN values, and after backward "d_*"}]
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np

from qkv.errors import QkvError
from qkv.ref.attention import split_heads
from qkv.ref.ffn import GLUCache
from qkv.ref.functional import ACTIVATIONS, Grads, linear_backward, linear_forward, scope
from qkv.ref.kernels import Kernel, NaiveCache, kernel_grads, naive_steps
from qkv.ref.mla import LatentCache
from qkv.ref.moe import MoECache
from qkv.ref.norms import LayerNormCache


class Recorder:
    def __init__(self):
        self.blocks: list[dict] = []  # one record per block call, in forward order
        self.current: dict | None = None  # the part whose sublayer is running (the kernel writes into it)
        self._parts: dict[int, dict] = {}  # id(wrapped sublayer) -> its part's record

    # ---- wrappers the engine's block_forward asks for -------------------------------------------

    def context(self, ctx):
        """The attention context with its kernel recorded."""
        if getattr(ctx.kernel, "recorded", False):
            return ctx
        return replace(ctx, kernel=self.kernel(ctx.kernel))

    def block(self, residual, parts, params: dict, cfg):
        """The block's placement and parts, each recording into a new block record."""
        record = {"parts": []}
        self.blocks.append(record)
        wrapped = []
        for name, norm_name, norm, sub in parts:
            part = {"name": name}
            record["parts"].append(part)
            if residual.paired:  # sandwich: (inner, outer)
                norm = (self.norm(norm[0], part, "norm_inner"), self.norm(norm[1], part, "norm_outer"))
            else:
                norm = self.norm(norm, part, "norm")
            sub = self.sublayer(sub, part, scope(params, name))
            self._parts[id(sub)] = part
            wrapped.append((name, norm_name, norm, sub))
        return self.residual(residual), wrapped

    # ---- the wrappers ---------------------------------------------------------------------------

    def residual(self, inner):
        def forward(x, norm, sub):
            y, cache = inner.forward(x, norm, sub)
            self._parts[id(sub)].update(stream_in=x, stream_out=y)
            return y, cache

        def backward(dy, cache, norm, sub, norm_grads, sub_grads):
            dx = inner.backward(dy, cache, norm, sub, norm_grads, sub_grads)
            self._parts[id(sub)].update(d_stream_out=dy, d_stream_in=dx)
            return dx

        return inner._replace(forward=forward, backward=backward)

    def norm(self, inner, part: dict, key: str):
        def forward(x):
            y, cache = inner.forward(x)
            if isinstance(cache, LayerNormCache):  # mu = x - (x - mu); sigma^2 as the norm used it
                stats = {"mean": (x - cache.centered)[..., 0], "var": cache.var[..., 0]}
            else:  # RMSNorm caches (x, r, gamma): the root mean square is 1 / r
                stats = {"rms": 1.0 / cache[1][..., 0]}
            part[key] = {"input": x, "output": y, **stats}
            return y, cache

        def backward(dy, cache, grads):
            dx = inner.backward(dy, cache, grads)
            part[key].update(d_output=dy, d_input=dx)
            return dx

        return inner._replace(forward=forward, backward=backward)

    def sublayer(self, inner, part: dict, params: dict):
        def forward(x):
            self.current = part
            y, cache = inner.forward(x)
            part.update(input=x, output=y)
            if part["name"].endswith("attn"):
                self._attention(part, params, cache)
            else:
                self._ffn(part, cache)
            return y, cache

        def backward(dy, cache, grads):
            self.current = part
            dx = inner.backward(dy, cache, grads)
            part.update(d_output=dy, d_input=dx)
            if "hidden" in part and not isinstance(cache, MoECache):
                down = cache.down_proj if isinstance(cache, GLUCache) else cache[2]
                part["d_hidden"] = linear_backward(dy, down, Grads())  # dA2 = dC W2^T (000 LLM §3.3.2)
            return dx

        return inner._replace(forward=forward, backward=backward)

    def kernel(self, inner: Kernel) -> Kernel:
        def forward(q, k, v, *, mask, causal, bias, scale, value_bias=None):
            out, cache = inner.forward(q, k, v, mask=mask, causal=causal, bias=bias, scale=scale,
                                       value_bias=value_bias)
            if not isinstance(cache, NaiveCache):
                raise QkvError("qkv explain shows softmax attention A = softmax(S); this kernel forms no A")
            allowed = np.ones(cache.weights.shape[-2:], bool) if cache.allowed is None else cache.allowed
            allowed = allowed[:, 0] if allowed.ndim == 4 else allowed  # (B, 1, T, S) -> (B, T, S): one for all heads
            self.current.update(q=cache.q, k=cache.k, v=cache.v, scores=cache.scores, weights=cache.weights,
                                allowed=np.broadcast_to(allowed, cache.weights.shape[:1] + cache.weights.shape[-2:]),
                                heads=out, bias=None if bias is None else np.broadcast_to(bias, cache.weights.shape))
            return out, cache

        def backward(dout, cache):
            steps = naive_steps(dout, cache)  # the kernel's own backward steps (000 LLM §3.3.3 steps 1-4)
            self.current.update(d_heads=dout, d_v=steps.dv, d_weights=steps.dweights, d_scores=steps.dscores,
                                d_q=steps.dq, d_k=steps.dk)
            return kernel_grads(steps, cache)

        wrapped = inner._replace(forward=forward, backward=backward)
        return _Recorded(*wrapped)

    # ---- what each sublayer's cache holds -------------------------------------------------------

    def _attention(self, part: dict, params: dict, cache) -> None:
        """The concatenated heads (W^O's input) and, for the positional step, Q and K as projected (before
        model.qk_norm's norm and the rotation)."""
        heads = cache.ctx.n_heads
        part["merged"] = cache.o_proj[0]  # Concat(head_1..head_h)   (B, T, H*Dh)
        if isinstance(cache, LatentCache):  # latent attention: q and k are made from latents, not one projection
            part["cross"] = False
            return
        part["cross"] = cache.cross
        q_raw = linear_forward(cache.q_proj[0], **scope(params, "q_proj"))[0]  # H W_Q, as the forward
        k_raw = linear_forward(cache.k_proj[0], **scope(params, "k_proj"))[0]
        part["q_raw"] = split_heads(q_raw, heads)
        part["k_raw"] = split_heads(k_raw, heads * k_raw.shape[-1] // q_raw.shape[-1])

    def _ffn(self, part: dict, cache) -> None:
        if isinstance(cache, MoECache):  # routing: the scores s, the top-k experts and their gates
            tokens = cache.shape[:-1]  # the engine routes (N, .) rows: back to (B, T, .)
            part.update(router_probs=cache.scores.reshape(*tokens, -1), experts=cache.top.reshape(*tokens, -1),
                        gates=cache.gates.reshape(*tokens, -1))
            return
        if isinstance(cache, GLUCache):
            pre, act = cache.activation
            part.update(pre_activation=pre, hidden=cache.down_proj[0], gate=cache.act, up=cache.up)
        else:
            (_, _, _), (pre, act), (hidden, _, _) = cache  # (c1, cact, c2) of mlp_forward
            part.update(pre_activation=pre, hidden=hidden)
        part["activation"] = act
        part["activation_grad"] = ACTIVATIONS.get(act)[1](pre)  # act'(A1): the mask the backward multiplies by


class _Recorded(Kernel):
    """A recorded kernel (so a context is wrapped once)."""

    recorded = True
