"""Independent torch float64 implementations of every layer case in qkv.ref.gradcheck.CASES: plain
torch formulas, torch.nn.functional, or the torch engine's own modules (qkv.nn). Each maps the case's
inputs (as torch tensors) to its output, so autograd gives the oracle gradients."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.func import functional_call

from qkv.nn import positional as tpos
from qkv.nn.attention import Attention, AttentionContext
from qkv.nn.block import Block
from qkv.nn.ffn import ACTIVATIONS, GLU, MLP, ClampedGLU
from qkv.nn.mla import LatentAttention
from qkv.nn.norms import LayerNorm, RMSNorm
from qkv.nn.residual import RESIDUALS
from qkv.ref import cases

B, T, S, D, H, F_, V, Dh = cases.B, cases.T, cases.S, cases.D, cases.H, cases.F, cases.V, cases.Dh
ORACLES = {}


def oracle(*names):
    def add(fn):
        for name in names:
            ORACLES[name] = fn
        return fn
    return add


def sub(inputs, prefix):
    return {k[len(prefix) + 1:]: v for k, v in inputs.items() if k.startswith(prefix + ".")}


@oracle("linear")
def _linear(i):
    return F.linear(i["x"], i["p.weight"], i["p.bias"])


@oracle("embedding")
def _embedding(i):
    return F.embedding(i["ids"], i["weight"])


@oracle("cross_entropy")
def _ce(i):
    return F.cross_entropy(i["logits"].reshape(-1, V), i["targets"].reshape(-1))


@oracle("cross_entropy_smoothed_ignore")
def _ce_smoothed(i):
    return F.cross_entropy(i["logits"].reshape(-1, V), i["targets"].reshape(-1), label_smoothing=0.1, ignore_index=-100)


@oracle("soft_cap")
def _soft_cap(i):
    return 1.5 * torch.tanh(i["x"] / 1.5)


@oracle("softmax")
def _softmax(i):
    return i["x"].softmax(-1)


for _act in ACTIVATIONS.names():
    ORACLES[f"activation_{_act}"] = lambda i, _act=_act: ACTIVATIONS.get(_act)(i["x"])


@oracle("norm_layernorm")
def _layernorm(i):
    return F.layer_norm(i["x"], (D,), i["weight"], i["bias"], 1e-5)


@oracle("norm_rmsnorm")
def _rmsnorm(i):
    return F.rms_norm(i["x"], (D,), i["weight"], 1e-5)


def _ffn_module(kind, act):
    return (GLU if kind == "glu" else MLP)(D, F_, activation=act, bias=True).double()


ORACLES["ffn_glu_clamped"] = lambda i: functional_call(ClampedGLU(D, F_, activation="silu", bias=True).double(),
                                                       {k: v for k, v in i.items() if k != "x"}, (i["x"],))


for _kind, _act in (("mlp", "relu"), ("mlp", "gelu"), ("glu", "silu"), ("glu", "gelu")):
    ORACLES[f"ffn_{_kind}_{_act}"] = lambda i, _kind=_kind, _act=_act: functional_call(
        _ffn_module(_kind, _act), {k: v for k, v in i.items() if k != "x"}, (i["x"],))


@oracle("moe_top2")
def _moe(i):
    x = i["x"].reshape(-1, D)
    logits = x @ i["router.weight"].T
    top_logits, top = logits.topk(2, dim=-1)
    gates = top_logits.softmax(-1)
    out = torch.zeros_like(x)
    for e in range(3):
        y_e = functional_call(_ffn_module("glu", "silu"), sub(i, f"experts.{e}"), (x,))
        weight = (gates * (top == e)).sum(-1, keepdim=True)  # g_e, or 0 when e is not chosen
        out = out + weight * y_e
    return out.reshape(B, T, D)


@oracle(*cases.MOE_ROUTINGS)
def _moe_routed(i):
    """The families' routing written out token by token with torch ops (the sort by plain Python)."""
    name = next(n for n, spec in cases.MOE_ROUTINGS.items() if ("shared.up_proj.weight" in i) == spec.get("shared", False)
                and ("router_bias" in i) == spec.get("bias", False))
    r = cases.MOE_ROUTINGS[name]["routing"]
    x = i["x"].reshape(-1, D)
    logits = x @ i["router.weight"].T
    scores = logits.softmax(-1) if r.scoring == "softmax" else torch.sigmoid(logits)
    bias = i.get("router_bias")
    glu = _ffn_module("glu", "silu")
    rows = []
    for n in range(x.shape[0]):
        ranked = [scores[n, e].item() + (bias[e].item() if bias is not None else 0.0) for e in range(4)]
        allowed = range(4)
        if r.groups:  # the better of 2 groups
            groups = [ranked[:2], ranked[2:]]
            rank = [sum(sorted(g)[-2:]) if r.scoring == "sigmoid" else max(g) for g in groups]
            allowed = range(0, 2) if rank[0] >= rank[1] else range(2, 4)
        top = sorted(allowed, key=lambda e: -ranked[e])[:2]
        weights = torch.stack([scores[n, e] for e in top])
        gates = r.scale * (weights / weights.sum() if r.normalize else weights)
        row = sum(g * functional_call(glu, sub(i, f"experts.{e}"), (x[n:n + 1],))[0] for g, e in zip(gates, top))
        if "shared.up_proj.weight" in i:
            row = row + functional_call(glu, sub(i, "shared"), (x[n:n + 1],))[0]
        rows.append(row)
    return torch.stack(rows).reshape(B, T, D)


def attention_reference(q, k, v, *, mask, causal, bias, scale, pattern=None):
    scores = q @ k.transpose(-1, -2) * scale
    if bias is not None:
        scores = scores + bias
    t, s = q.shape[-2], k.shape[-2]
    allowed = torch.ones(t, s, dtype=torch.bool)
    if mask is not None:
        allowed = allowed & mask
    elif causal:
        allowed = allowed & torch.from_numpy(cases.kernels.causal_mask(t, s))
    if pattern is not None:
        allowed = allowed & torch.from_numpy(pattern)
    return scores.masked_fill(~allowed, float("-inf")).softmax(-1) @ v


def _kernel_oracle(causal=True, pattern=None):
    def run(i):
        p = None if pattern is None else pattern(i["q"].shape[-2], i["k"].shape[-2], cases.cfg(window=2))
        return attention_reference(i["q"], i["k"], i["v"], mask=i["mask"], causal=causal, bias=i["bias"],
                                   scale=Dh ** -0.5, pattern=p)
    return run


ORACLES["kernel_naive_causal"] = ORACLES["kernel_naive_padding"] = _kernel_oracle()
ORACLES["kernel_naive_cached_keys"] = ORACLES["kernel_flash_causal"] = _kernel_oracle()
ORACLES["kernel_flash_padding_bias"] = _kernel_oracle()
ORACLES["kernel_naive_bias_full"] = ORACLES["kernel_flash_full_rect"] = _kernel_oracle(causal=False)
for _kind in ("local", "dilated", "random"):
    ORACLES[f"kernel_{_kind}"] = _kernel_oracle(pattern=getattr(cases.kernels, f"{_kind}_pattern"))


def _linear_oracle(causal):
    def run(i):
        qf, kf = F.elu(i["q"]) + 1, F.elu(i["k"]) + 1
        weights = qf @ kf.transpose(-1, -2)
        if causal:
            weights = weights.tril()
        return weights / weights.sum(-1, keepdim=True) @ i["v"]
    return run


ORACLES["kernel_linear_causal"], ORACLES["kernel_linear_full"] = _linear_oracle(True), _linear_oracle(False)


@oracle("rope")
def _rope(i):
    rot = tpos.Rotary(head_dim=Dh, rope_theta=10000.0)
    positions = torch.arange(T).expand(B, T) + 3
    return torch.stack(rot.rotate(i["q"], i["k"], positions))


@oracle("learned_positions")
def _learned(i):
    return i["x"] + i["weight"][torch.tensor([[0, 0, 0, 1, 2], [0, 1, 2, 3, 4]])]


def torch_context(positional="none", s=T, causal=True, mask=None):
    pos = tpos.POSITIONALS.get(positional)(d_model=D, n_heads=H, head_dim=Dh, max_seq_len=16,
                                           rope_theta=10000.0, max_distance=16).double()
    return AttentionContext(pos, torch.arange(T).expand(B, T) + s - T if s >= T else torch.arange(T).expand(B, T),
                            torch.arange(s).expand(B, s), mask, causal)


def _attention_oracle(kv_heads=H, positional="none", cross=False, mask=False):
    def run(i):
        module = Attention(D, H, kv_heads, kernel="sdpa", bias=True).double()
        params = {k: v for k, v in i.items() if k not in ("x", "memory")}
        if cross:
            ctx = torch_context(s=S, causal=False)
            return functional_call(module, params, (i["x"], ctx, None, i["memory"]))
        m = torch.from_numpy(cases._padding_mask(T, T)) if mask else None
        return functional_call(module, params, (i["x"], torch_context(positional, mask=m, causal=m is None)))
    return run


ORACLES["attention_mha"] = _attention_oracle()
ORACLES["attention_gqa_rope_padding"] = _attention_oracle(kv_heads=1, positional="rope", mask=True)


def _latent_oracle(q_rank: int, mask: bool = False):
    """The torch engine's LatentAttention (qkv.nn.mla; a call without a cache: its per-head form)."""
    def run(i):
        m = cases.MLA
        module = LatentAttention(D, m["heads"], kv_rank=m["rank"], q_rank=q_rank, head_dim=m["nope"] + m["rope"],
                                 rope_dims=m["rope"], v_dim=m["v_dim"], norm_eps=1e-5).double()
        pos = tpos.Rotary(head_dim=m["rope"], rope_theta=10000.0).double()
        positions = torch.arange(T).expand(B, T)
        padding = torch.from_numpy(cases._padding_mask(T, T)) if mask else None
        ctx = AttentionContext(pos, positions, positions, padding, not mask)
        return functional_call(module, {k: v for k, v in i.items() if k != "x"}, (i["x"], ctx))
    return run


ORACLES["mla_latent_q"] = _latent_oracle(cases.MLA["q_rank"])
ORACLES["mla_full_q_padding"] = _latent_oracle(0, mask=True)
ORACLES["attention_alibi"] = _attention_oracle(positional="alibi")
ORACLES["cross_attention"] = _attention_oracle(cross=True)


def _block_oracle(placement, norm, cross=False):
    def run(i):
        make_norm = (lambda: LayerNorm(D, eps=1e-5)) if norm == "layernorm" else (lambda: RMSNorm(D, eps=1e-5))
        block = Block(attn=Attention(D, H, H, kernel="sdpa", bias=True), ffn=MLP(D, F_, activation="gelu", bias=True),
                      attn_norm=make_norm(), ffn_norm=make_norm(), residual=RESIDUALS.get(placement).apply,
                      cross_attn=Attention(D, H, H, kernel="sdpa", bias=True) if cross else None,
                      cross_norm=make_norm() if cross else None).double()
        params = {k: v for k, v in i.items() if k not in ("x", "memory")}
        memory_ctx = torch_context(s=S, causal=False) if cross else None
        return functional_call(block, params, (i["x"], torch_context(), None, i.get("memory"), memory_ctx))
    return run


ORACLES["block_pre_layernorm"] = _block_oracle("pre", "layernorm")
ORACLES["block_post_rmsnorm"] = _block_oracle("post", "rmsnorm")
ORACLES["block_cross_pre"] = _block_oracle("pre", "layernorm", cross=True)


# ---- learnt score biases, value terms, linear attention's explicit form, sandwich (qkv.ref.cases_relative) ----

from torch import nn  # noqa: E402

from qkv.nn.kernels import weights_for  # noqa: E402
from qkv.nn.residual import NormPair  # noqa: E402
from qkv.ref import cases_relative  # noqa: E402


class AttentionWithPositional(nn.Module):
    """The torch engine's Attention and a positional module as one parameter tree ("positional.*")."""

    def __init__(self, name, kernel):
        super().__init__()
        self.attn = Attention(D, H, H, kernel=kernel, bias=True)
        self.positional = tpos.POSITIONALS.get(name)(d_model=D, n_heads=H, head_dim=Dh, max_seq_len=16,
                                                     rope_theta=10000.0, max_distance=cases_relative.MAX_DISTANCE)

    def forward(self, x, mask, causal):
        positions = torch.arange(T).expand(B, T)
        return self.attn(x, AttentionContext(self.positional, positions, positions, mask, causal))


def _relative_oracle(name, kernel, causal, padded):
    def run(i):
        module = AttentionWithPositional(name, kernel).double()
        params = {(k if k.startswith("positional.") else f"attn.{k}"): v for k, v in i.items() if k != "x"}
        mask = torch.from_numpy(cases_relative.padding_mask(causal)) if padded else None
        return functional_call(module, params, (i["x"], mask, causal and not padded))
    return run


for _case, _spec in cases_relative.RELATIVE_CASES.items():
    ORACLES[_case] = _relative_oracle(*_spec)


def _weights_oracle(kind, window=2):
    """The torch engine's explicit weights for kernel `kind` (its own pattern / feature map), times V."""
    def run(i):
        weights = weights_for(kind, window=window)(i["q"], i["k"], mask=i["mask"], causal=True, bias=i["bias"],
                                                   scale=Dh ** -0.5)
        return weights.to(i["v"].dtype) @ i["v"]
    return run


ORACLES["kernel_random"] = _weights_oracle("random")  # the torch engine's BigBird pattern, not ours
ORACLES["kernel_random_padding"] = _weights_oracle("random", window=1)
ORACLES["kernel_linear_padding_bias"] = _weights_oracle("linear")


@oracle("block_sandwich_layernorm")
def _sandwich_block(i):
    pair = lambda: NormPair(LayerNorm(D, eps=1e-5), LayerNorm(D, eps=1e-5))  # noqa: E731
    block = Block(attn=Attention(D, H, H, kernel="sdpa", bias=True), ffn=MLP(D, F_, activation="gelu", bias=True),
                  attn_norm=pair(), ffn_norm=pair(), residual=RESIDUALS.get("sandwich").apply).double()
    return functional_call(block, {k: v for k, v in i.items() if k != "x"}, (i["x"], torch_context()))


@oracle("moe_top2_capacity")
def _moe_capacity(i):
    from qkv.nn.moe import MoE

    module = MoE(D, F_, experts=3, top_k=2, capacity_factor=0.5, ffn="glu", activation="silu", bias=True).double()
    return functional_call(module, {k: v for k, v in i.items() if k != "x"}, (i["x"],))
