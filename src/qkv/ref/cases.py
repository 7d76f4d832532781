"""The layer cases that qkv.ref.gradcheck proves: tiny inputs (B=2, T=5, D=8, H=2, Dh=4, F=12, V=7),
each with its forward and its backward mapped to {input name: gradient}."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from qkv.ref import functional as fn, kernels, model, positional
from qkv.ref.attention import MEMORY_GRAD, AttentionContext, attention_backward, attention_forward
from qkv.ref.block import block_backward, block_forward
from qkv.ref.ffn import FFNS
from qkv.ref.flash import flash_backward, flash_forward
from qkv.ref.gradcheck import CASES, Case, layer_grads
from qkv.ref.mla import latent_backward, latent_forward
from qkv.ref.moe import Routing, moe_backward, moe_forward
from qkv.ref.norms import NORMS
from qkv.config import ModelConfig
from qkv.ref.model import loss_and_grads

B, T, S, D, H, F, V = 2, 5, 6, 8, 2, 12, 7
Dh = D // H


def cfg(**overrides):
    """The few ModelConfig fields the layers read, without importing the config machinery's validation."""
    base = dict(d_model=D, n_heads=H, head_dim=Dh, rope_theta=10000.0, norm="layernorm", norm_eps=1e-5,
                norm_placement="pre", ffn="mlp", activation="gelu", moe_experts=0, moe_top_k=2, window=2,
                attention="naive")
    base.update(overrides)
    return SimpleNamespace(**base)


def _normal(rng, *shape, scale=1.0):
    return rng.normal(scale=scale, size=shape)


def linear_params(rng, prefix, n_out, n_in, bias=True):
    params = {f"{prefix}.weight": _normal(rng, n_out, n_in, scale=0.5)}
    if bias:
        params[f"{prefix}.bias"] = _normal(rng, n_out, scale=0.1)
    return params


# ---- functional ------------------------------------------------------------------------------

CASES.register("linear")(Case(
    lambda rng: {"x": _normal(rng, B, T, D), **linear_params(rng, "p", F, D)},
    lambda i: fn.linear_forward(i["x"], i["p.weight"], i["p.bias"]),
    lambda dy, c: layer_grads(fn.linear_backward, dy, c, prefix="p.")))

CASES.register("embedding")(Case(
    lambda rng: {"ids": rng.integers(0, V, (B, T)), "weight": _normal(rng, V, D)},
    lambda i: fn.embedding_forward(i["ids"], i["weight"]),
    lambda dy, c: layer_grads(fn.embedding_backward, dy, c)))


def _ce_case(smoothing, ignore):
    def inputs(rng):
        targets = rng.integers(0, V, (B, T))
        if ignore:
            targets[0, :2] = -100
        return {"logits": _normal(rng, B, T, V, scale=2.0), "targets": targets}

    return Case(inputs, lambda i: fn.cross_entropy_forward(i["logits"], i["targets"], label_smoothing=smoothing),
                lambda dy, c: {"logits": fn.cross_entropy_backward(dy, c)})


CASES.register("cross_entropy")(_ce_case(0.0, False))
CASES.register("cross_entropy_smoothed_ignore")(_ce_case(0.1, True))

CASES.register("softmax")(Case(
    lambda rng: {"x": _normal(rng, B, T, V)},
    lambda i: (lambda a: (a, a))(fn.softmax(i["x"])),
    lambda dy, a: {"x": fn.softmax_backward(dy, a)}))

CASES.register("soft_cap")(Case(  # logits up to ~3c: the cap bends them
    lambda rng: {"x": _normal(rng, B, T, V, scale=3.0)},
    lambda i: fn.soft_cap_forward(i["x"], 1.5),
    lambda dy, squashed: {"x": fn.soft_cap_backward(dy, squashed)}))

for _act in fn.ACTIVATIONS.names():
    CASES.register(f"activation_{_act}")(Case(
        lambda rng: {"x": _normal(rng, B, T, F, scale=3.0)},
        lambda i, _act=_act: fn.activation_forward(i["x"], _act),
        lambda dy, c: {"x": fn.activation_backward(dy, c)}))

# ---- norms, FFNs, MoE ------------------------------------------------------------------------

for _norm in NORMS.names():
    CASES.register(f"norm_{_norm}")(Case(
        lambda rng: {"x": _normal(rng, B, T, D, scale=2.0) + 1.0, "weight": 1 + _normal(rng, D, scale=0.3),
                     "bias": _normal(rng, D, scale=0.3)},
        lambda i, _norm=_norm: NORMS.get(_norm).forward(i, i["x"], 1e-5),
        lambda dy, c, _norm=_norm: layer_grads(NORMS.get(_norm).backward, dy, c)))


def _ffn_inputs(rng, kind, prefix=""):
    names = ("gate_proj", "up_proj") if kind == "glu" else ("up_proj",)
    params = {}
    for name in names:
        params.update(linear_params(rng, f"{prefix}{name}", F, D))
    params.update(linear_params(rng, f"{prefix}down_proj", D, F))
    return params


for _ffn, _act in (("mlp", "relu"), ("mlp", "gelu"), ("glu", "silu"), ("glu", "gelu")):
    CASES.register(f"ffn_{_ffn}_{_act}")(Case(
        lambda rng, _ffn=_ffn: {"x": _normal(rng, B, T, D), **_ffn_inputs(rng, _ffn)},
        lambda i, _ffn=_ffn, _act=_act: FFNS.get(_ffn).forward(i, i["x"], _act),
        lambda dy, c, _ffn=_ffn: layer_grads(FFNS.get(_ffn).backward, dy, c)))


CASES.register("ffn_glu_clamped")(Case(  # gpt-oss's SwiGLU, inputs wide enough that both clamps bite
    lambda rng: {"x": _normal(rng, B, T, D, scale=3.0), **_ffn_inputs(rng, "glu")},
    lambda i: FFNS.get("glu_clamped").forward(i, i["x"], "silu"),
    lambda dy, c: layer_grads(FFNS.get("glu_clamped").backward, dy, c)))


def _moe_inputs(rng, experts=3):
    params = {"x": _normal(rng, B, T, D), "router.weight": _normal(rng, experts, D)}
    for e in range(experts):
        params.update(_ffn_inputs(rng, "glu", f"experts.{e}."))
    return params


CASES.register("moe_top2")(Case(
    _moe_inputs,
    lambda i: moe_forward(i, i["x"], ffn="glu", activation="silu", experts=3, top_k=2, aux_weight=0.0),
    lambda dy, c: layer_grads(moe_backward, dy, c)))

# each family's routing (qkv.nn.moe): OLMoE's unnormalised gates, DeepSeek-V2's groups ranked by their best
# score with a scale and a shared expert, DeepSeek-V3's sigmoid scores with a choosing bias and groups ranked
# by their two best
MOE_ROUTINGS = {
    "moe_olmoe": dict(routing=Routing(normalize=False)),
    "moe_deepseek_v2": dict(routing=Routing(normalize=False, scale=2.5, groups=2, group_top_k=1), shared=True),
    "moe_deepseek_v3": dict(routing=Routing(scoring="sigmoid", scale=2.5, groups=2, group_top_k=1), shared=True,
                            bias=True),
}


def _routed_inputs(rng, shared=False, bias=False, **_):
    params = _moe_inputs(rng, experts=4)
    if shared:
        params.update(_ffn_inputs(rng, "glu", "shared."))
    if bias:  # positive: the groups' ranks then agree with transformers' masking by 0 (qkv.nn.moe)
        params["router_bias"] = rng.uniform(0.0, 0.1, size=4)
    return params


for _name, _spec in MOE_ROUTINGS.items():
    CASES.register(_name)(Case(
        lambda rng, _spec=_spec: _routed_inputs(rng, **_spec),
        lambda i, _spec=_spec: moe_forward(i, i["x"], ffn="glu", activation="silu", experts=4, top_k=2,
                                           routing=_spec["routing"]),
        lambda dy, c: layer_grads(moe_backward, dy, c)))

# ---- attention kernels -----------------------------------------------------------------------


def _qkv(rng, t=T, s=T):
    return {"q": _normal(rng, B, H, t, Dh), "k": _normal(rng, B, H, s, Dh), "v": _normal(rng, B, H, s, Dh)}


def _padding_mask(t, s):
    keep = np.ones((B, s), dtype=bool)
    keep[0, :2] = False  # row 0 is left-padded by two
    return (keep[:, None, None, :] & kernels.causal_mask(t, s)) | np.eye(t, s, s - t, dtype=bool)


def _kernel_case(make_kernel, *, mask=False, causal=True, bias=False, t=T, s=T):
    def inputs(rng):
        values = _qkv(rng, t, s)
        values["mask"] = _padding_mask(t, s) if mask else None
        values["bias"] = _normal(rng, 1, H, t, s) if bias else None
        return values

    def forward(i):
        return make_kernel().forward(i["q"], i["k"], i["v"], mask=i["mask"], causal=causal, bias=i["bias"],
                                     scale=Dh ** -0.5)

    def backward(dy, cache):
        return dict(zip("qkv", make_kernel().backward(dy, cache)))

    return Case(inputs, forward, backward, wrt=("q", "k", "v"))


_flash_tiny = lambda: kernels.Kernel(lambda *a, **k: flash_forward(*a, **k, block=2), flash_backward)  # noqa: E731
CASES.register("kernel_naive_causal")(_kernel_case(lambda: kernels.KERNELS.get("naive")(cfg())))
CASES.register("kernel_naive_padding")(_kernel_case(lambda: kernels.KERNELS.get("naive")(cfg()), mask=True))
CASES.register("kernel_naive_bias_full")(_kernel_case(lambda: kernels.KERNELS.get("naive")(cfg()), causal=False,
                                                      bias=True))
CASES.register("kernel_naive_cached_keys")(_kernel_case(lambda: kernels.KERNELS.get("naive")(cfg()), t=3, s=T))
for _kind in ("local", "dilated", "random"):
    CASES.register(f"kernel_{_kind}")(_kernel_case(lambda _kind=_kind: kernels.KERNELS.get(_kind)(cfg(window=2))))
CASES.register("kernel_flash_causal")(_kernel_case(_flash_tiny))
CASES.register("kernel_flash_padding_bias")(_kernel_case(_flash_tiny, mask=True, bias=True))
CASES.register("kernel_flash_full_rect")(_kernel_case(_flash_tiny, causal=False, t=3, s=S))
CASES.register("kernel_linear_causal")(_kernel_case(lambda: kernels.KERNELS.get("linear")(cfg())))
CASES.register("kernel_linear_full")(_kernel_case(lambda: kernels.KERNELS.get("linear")(cfg()), causal=False, t=3, s=S))

# ---- positional, attention layers, block -----------------------------------------------------

CASES.register("rope")(Case(
    lambda rng: {"q": _normal(rng, B, H, T, Dh), "k": _normal(rng, B, H, T, Dh)},
    lambda i: (lambda q, k, c: (np.stack((q, k)), c))(*positional.Rotary(cfg()).rotate_forward(
        i["q"], i["k"], np.broadcast_to(np.arange(T) + 3, (B, T)))),
    lambda dy, c: dict(zip("qk", positional.Rotary(cfg()).rotate_backward(dy[0], dy[1], c)))))

CASES.register("learned_positions")(Case(
    lambda rng: {"x": _normal(rng, B, T, D), "weight": _normal(rng, T + 2, D)},
    lambda i: positional.Learned(cfg()).embed_forward(i, i["x"], np.array([[0, 0, 0, 1, 2], [0, 1, 2, 3, 4]])),
    lambda dy, c: layer_grads(positional.Learned(cfg()).embed_backward, dy, c)))


def attention_params(rng, prefix="", kv_heads=H, bias=True):
    params = linear_params(rng, f"{prefix}q_proj", D, D, bias)
    params.update(linear_params(rng, f"{prefix}k_proj", kv_heads * Dh, D, bias))
    params.update(linear_params(rng, f"{prefix}v_proj", kv_heads * Dh, D, bias))
    params.update(linear_params(rng, f"{prefix}o_proj", D, D, bias))
    return params


def context(positional_name="none", kernel="naive", t=T, s=T, causal=True, mask=None):
    pos = positional.POSITIONALS.get(positional_name)(cfg())
    return AttentionContext(pos, np.broadcast_to(np.arange(t) + s - t, (B, t)), np.broadcast_to(np.arange(s), (B, s)),
                            mask, causal, kernels.KERNELS.get(kernel)(cfg()), H)


def with_memory(grads: dict) -> dict:
    """A cross-attention's memory gradient (accumulated under MEMORY_GRAD) as the case's "memory" input."""
    if MEMORY_GRAD in grads:
        grads["memory"] = grads.pop(MEMORY_GRAD)
    return grads


def _attention_case(kv_heads=H, positional_name="none", cross=False, mask=False):
    def inputs(rng):
        values = {"x": _normal(rng, B, T, D), **attention_params(rng, kv_heads=kv_heads)}
        if cross:
            values["memory"] = _normal(rng, B, S, D)
        return values

    def forward(i):
        ctx = (context(s=S, causal=False) if cross else
               context(positional_name, mask=_padding_mask(T, T) if mask else None))
        return attention_forward(i, i["x"], ctx, i.get("memory"))

    return Case(inputs, forward, lambda dy, cache: with_memory(layer_grads(attention_backward, dy, cache)))


MLA = dict(heads=H, nope=3, rope=2, v_dim=3, rank=5, q_rank=4)  # the latent attention cases' sizes


def latent_params(rng, q_rank: int) -> dict:
    """qkv.nn.mla.LatentAttention's parameters (no biases, as DeepSeek's): MLA's sizes above."""
    h, n, r_, v, c = MLA["heads"], MLA["nope"], MLA["rope"], MLA["v_dim"], MLA["rank"]
    params = ({**linear_params(rng, "q_a_proj", q_rank, D, False), "q_a_norm.weight": 1 + _normal(rng, q_rank, scale=0.2),
               **linear_params(rng, "q_b_proj", h * (n + r_), q_rank, False)} if q_rank else
              linear_params(rng, "q_proj", h * (n + r_), D, False))
    params.update(linear_params(rng, "kv_a_proj", c + r_, D, False))
    params["kv_a_norm.weight"] = 1 + _normal(rng, c, scale=0.2)
    params.update(linear_params(rng, "kv_b_proj", h * (n + v), c, False))
    params.update(linear_params(rng, "o_proj", D, h * v, False))
    return params


def _latent_case(q_rank: int, mask: bool = False):
    def forward(i):
        pos = positional.POSITIONALS.get("rope")(cfg(head_dim=MLA["rope"]))
        ctx = AttentionContext(pos, np.broadcast_to(np.arange(T), (B, T)), np.broadcast_to(np.arange(T), (B, T)),
                               _padding_mask(T, T) if mask else None, not mask, kernels.KERNELS.get("naive")(cfg()), H)
        return latent_forward(i, i["x"], ctx)

    return Case(lambda rng: {"x": _normal(rng, B, T, D), **latent_params(rng, q_rank)}, forward,
                lambda dy, cache: layer_grads(latent_backward, dy, cache))


CASES.register("mla_latent_q")(_latent_case(q_rank=MLA["q_rank"]))
CASES.register("mla_full_q_padding")(_latent_case(q_rank=0, mask=True))

CASES.register("attention_mha")(_attention_case())
CASES.register("attention_gqa_rope_padding")(_attention_case(kv_heads=1, positional_name="rope", mask=True))
CASES.register("attention_alibi")(_attention_case(positional_name="alibi"))
CASES.register("cross_attention")(_attention_case(cross=True))


def _block_case(placement, norm, cross=False):
    def inputs(rng):
        values = {"x": _normal(rng, B, T, D), **attention_params(rng, "attn."), **_ffn_inputs(rng, "mlp", "ffn.")}
        norms = ("attn_norm", "ffn_norm", "cross_norm") if cross else ("attn_norm", "ffn_norm")
        if placement == "sandwich":  # an (inner, outer) pair per sublayer
            norms = tuple(f"{name}.{side}" for name in norms for side in ("inner", "outer"))
        for name in norms:
            values[f"{name}.weight"] = 1 + _normal(rng, D, scale=0.2)
            if norm == "layernorm":
                values[f"{name}.bias"] = _normal(rng, D, scale=0.2)
        if cross:
            values.update(attention_params(rng, "cross_attn."))
            values["memory"] = _normal(rng, B, S, D)
        return values

    def forward(i):
        c = cfg(norm=norm, norm_placement=placement)
        memory_ctx = context(s=S, causal=False) if cross else None
        return block_forward(i, i["x"], c, context(), memory=i.get("memory"), memory_ctx=memory_ctx)

    return Case(inputs, forward, lambda dy, cache: with_memory(layer_grads(block_backward, dy, cache)))


CASES.register("block_pre_layernorm")(_block_case("pre", "layernorm"))
CASES.register("block_post_rmsnorm")(_block_case("post", "rmsnorm"))
CASES.register("block_cross_pre")(_block_case("pre", "layernorm", cross=True))



# ---- whole models: the loss (CE + aux) as a function of every parameter, checked along 3 random
# directions per parameter array (every layer inside is checked element by element above) ----------

def _model_case(aux_weight=0.01, **overrides):
    model_cfg = ModelConfig(**{**dict(vocab_size=V, d_model=D, n_heads=H, n_layers=1, d_ff=F, max_seq_len=T),
                               **overrides})

    def inputs(rng):
        shapes = {"tok_emb.weight": (V, D), "final_norm.weight": (D,), "final_norm.bias": (D,)}
        if model_cfg.positional == "learned":
            shapes["positional.weight"] = (T, D)
        params = {name: _normal(rng, *shape, scale=0.5) for name, shape in shapes.items()}
        params["final_norm.weight"] += 1.0
        block = {**attention_params(rng, "attn."), "router.weight": _normal(rng, model_cfg.moe_experts, D)}
        for e in range(model_cfg.moe_experts):
            block.update(_ffn_inputs(rng, model_cfg.ffn, f"ffn.experts.{e}."))
        block["ffn.router.weight"] = block.pop("router.weight")
        for name in ("attn_norm", "ffn_norm"):
            block[f"{name}.weight"], block[f"{name}.bias"] = 1 + _normal(rng, D, scale=0.2), _normal(rng, D, scale=0.2)
        params.update({f"blocks.0.{name}": value for name, value in block.items()})
        ids = rng.integers(0, V, (B, T))
        return {**params, "ids": ids, "targets": np.roll(ids, -1, axis=1)}

    def forward(i):  # the loss alone: finite differences call this many times
        params = {k: v for k, v in i.items() if k not in ("ids", "targets")}
        logits, cache = model.forward(params, model_cfg, i["ids"], aux_weight=aux_weight)
        loss = fn.cross_entropy_forward(logits, i["targets"])[0] + aux_weight * model.aux_loss(cache)
        return loss, (params, i["ids"], i["targets"])

    def backward(dloss, cache):
        params, ids, targets = cache
        _, grads, _ = loss_and_grads(params, model_cfg, ids, targets, aux_weight=aux_weight)
        return {name: dloss * g for name, g in grads.items()}

    return Case(inputs, forward, backward, directions=3)


CASES.register("model_decoder_moe_flash_rope")(_model_case(moe_experts=3, moe_top_k=2, ffn="glu", activation="silu",
                                                           attention="flash", positional="rope"))
CASES.register("model_decoder_moe_top1_linear")(_model_case(moe_experts=2, moe_top_k=1, attention="linear"))
