"""Looking inside a model through its hook points (qkv.nn.hookpoints): caches of activations, hooks that
replace them, and the analyses built on them. One model code for every family, so these work the same on a
qkv-trained run, an imported Hugging Face model and a GGUF file.

    logits, cache = run_with_cache(model, ids, names=["blocks.3.resid_post", "blocks.3.attn.pattern"])
    logits = run_with_hooks(model, ids, hooks=[("blocks.3.attn.z", zero_head(5))])
    lens = logit_lens(model, ids)          # each layer's residual through the final norm and the head
    routes = expert_routes(model, ids)     # an MoE's chosen experts and gates per layer and token
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch
from torch import Tensor, nn

from qkv.errors import QkvError
from qkv.nn.hookpoints import Hook, hook_names, hooked
from qkv.nn.moe import MoE
from qkv.nn.norms import LayerNorm
from qkv.nn.residual import pre_norm, sandwich_norm


def run_with_cache(model: nn.Module, input_ids: Tensor, names: Sequence[str] | None = None, **forward
                   ) -> tuple[Tensor, dict[str, Tensor]]:
    """The logits and {name: activation} of every named point (all of them when `names` is None), detached;
    the pattern points only when named (forming A costs a T x S matrix per head)."""
    wanted = list(names) if names is not None else [n for n in hook_names(model)
                                                    if not n.endswith((".scores", ".pattern"))]
    cache: dict[str, Tensor] = {}

    def keep(x: Tensor, name: str) -> None:
        cache[name] = x.detach()

    with torch.no_grad(), hooked(model, [(name, keep) for name in wanted]):
        logits = model(input_ids, **forward)
    return logits, cache


def run_with_hooks(model: nn.Module, input_ids: Tensor, hooks: Sequence[tuple[str, Hook]], **forward) -> Tensor:
    """The logits with `hooks` [(point name, fn(x, name) -> replacement or None)] in place."""
    with torch.no_grad(), hooked(model, list(hooks)):
        return model(input_ids, **forward)


def zero_head(head: int) -> Hook:
    """A hook for `blocks.{i}.attn.z` that zeroes one head's output (zero ablation)."""
    def hook(z: Tensor, name: str) -> Tensor:
        z = z.clone()
        z[:, head] = 0
        return z
    return hook


def knock_out(query: int, keys: Sequence[int], heads: Sequence[int] | None = None) -> Hook:
    """A hook for `blocks.{i}.attn.scores` that stops `query` reading `keys` (attention knockout, Geva et al.
    2023): their scores become -inf, so the softmax shares the query's attention among its other keys
    (`heads`: those heads only; default all). The query must keep at least one key."""
    def hook(scores: Tensor, name: str) -> Tensor:
        scores = scores.clone()
        rows = slice(None) if heads is None else list(heads)
        scores[:, rows, query, list(keys)] = float("-inf")
        if torch.isinf(scores[:, rows, query]).all(-1).any():
            raise QkvError(f"knock_out at {name}: query {query} would read no key at all")
        return scores
    return hook


def patch_from(cache: dict[str, Tensor], positions: Sequence[int] | None = None) -> Hook:
    """A hook that puts a cached (clean) activation in place of this run's (activation patching), at every
    position or at `positions` only (the position axis is -2 for (B, T, D) and (B, H, T, Dh) points)."""
    def hook(x: Tensor, name: str) -> Tensor:
        clean = cache[name]
        if positions is None:
            return clean.to(x.dtype)
        x = x.clone()
        x[..., list(positions), :] = clean[..., list(positions), :].to(x.dtype)
        return x
    return hook


def unembed(model: nn.Module) -> Callable[[Tensor], Tensor]:
    """Residual stream (..., D) -> logits (..., V) through the model's final norm and head (the logit lens)."""
    norm, head = getattr(model, "final_norm", None), getattr(model, "lm_head", None)
    if norm is None or head is None:
        raise QkvError(f"the logit lens needs a final norm and an output head; a {type(model).__name__} has "
                       f"{'no final norm' if norm is None else 'no head'}")
    return lambda x: head(norm(x))


def logit_lens(model: nn.Module, input_ids: Tensor, *, position: int = -1, target: int | None = None,
               top: int = 5) -> list[dict]:
    """nostalgebraist's logit lens (2020): each block's output resid_post (and the embedding) read through the
    final norm and the head, at one position. Per layer: the top tokens with their probabilities, and the rank
    and probability of `target` (default: the model's own final top token). The last row equals the model's
    own output distribution (the final block's resid_post through the same norm and head)."""
    blocks = len(model.blocks)
    names = ["embed"] + [f"blocks.{i}.resid_post" for i in range(blocks)]
    logits, cache = run_with_cache(model, input_ids, names)
    final = logits[0, position].float()
    target = int(final.argmax()) if target is None else target
    read = unembed(model)
    rows = []
    with torch.no_grad():
        for layer, name in enumerate(names):
            row = read(cache[name][:, position]).float()[0]
            probs = row.softmax(-1)
            best = torch.topk(probs, top)
            rows.append({"layer": layer, "point": name, "top": [(int(i), float(p)) for p, i in zip(*best)],
                         "target_rank": int((row > row[target]).sum()), "target_prob": float(probs[target])})
    return rows


def head_scores(model: nn.Module, input_ids: Tensor) -> dict[str, list[list[float]]]:
    """Per layer and head, from the attention patterns on `input_ids` (one row; queries from position 1 on):
    previous-token score, the mean weight on the key just before the query; first-token (sink) score, the mean
    weight on position 0 (Xiao et al. 2023's attention sinks)."""
    layers = len(model.blocks)
    _, cache = run_with_cache(model, input_ids[:1], [f"blocks.{i}.attn.pattern" for i in range(layers)])
    previous, first = [], []
    for i in range(layers):
        a = cache[f"blocks.{i}.attn.pattern"][0].float()  # (H, T, T)
        t = a.shape[-1]
        rows = torch.arange(1, t)
        previous.append(a[:, rows, rows - 1].mean(-1).tolist())
        first.append(a[:, rows, 0].mean(-1).tolist())
    return {"previous_token": previous, "first_token": first}


def induction_scores(model: nn.Module, vocab: int, *, length: int = 25, seed: int = 0,
                     prefix: Sequence[int] = ()) -> list[list[float]]:
    """Per layer and head, the induction score of Olsson et al. (2022): on random tokens R repeated (`prefix`,
    R, R), the mean weight a query in the second R puts on the key just after its earlier occurrence (the
    token that came next last time). Random tokens have no meaning to copy: a high score is the mechanism."""
    g = torch.Generator().manual_seed(seed)
    r = torch.randint(0, vocab, (length,), generator=g).tolist()
    ids = torch.tensor([list(prefix) + r + r])
    start = len(prefix)
    layers = len(model.blocks)
    _, cache = run_with_cache(model, ids, [f"blocks.{i}.attn.pattern" for i in range(layers)])
    queries = torch.arange(start + length, start + 2 * length)  # the second copy
    keys = queries - length + 1  # just after the same token in the first copy
    return [cache[f"blocks.{i}.attn.pattern"][0].float()[:, queries, keys].mean(-1).tolist() for i in range(layers)]


def direct_logit_attribution(model: nn.Module, input_ids: Tensor, *, position: int = -1,
                             target: int | None = None) -> dict:
    """How much each component writes the target's logit directly (Elhage et al. 2021): a Pre-LN decoder's final
    residual is a sum, H^L = embed + sum_l (attn_l + ffn_l), and attn_l = sum_h z_h W^O_h^T + b^O; with the final
    norm's scale frozen at its value for this position (LayerNorm: 1 / sigma and the centring, both linear then;
    RMSNorm: 1 / rms), the target's logit is exactly the sum of each component's term plus the norm's and head's
    biases. Sandwich blocks (Gemma's four norms) add outer(attn_l) and outer(ffn_l): each outer norm's scale
    frozen too, its heads' terms stay a sum. Returns {"target", "logit", "constant", "components": [(name,
    term), ...]}; the terms and the constant add up to the logit (tests/interp/)."""
    blocks = list(model.blocks)
    sandwich = [block.residual is sandwich_norm for block in blocks]
    if any(block.residual not in (pre_norm, sandwich_norm) for block in blocks):
        raise QkvError("direct logit attribution needs Pre-LN or sandwich blocks, whose output is the sum of their "
                       "sublayers'; this model normalises the stream inside the blocks")
    names = ["embed", "final_norm"] + [f"blocks.{i}.{p}" for i in range(len(blocks))
                                       for p in ("attn.z", "attn.out", "ffn.post")]
    logits, cache = run_with_cache(model, input_ids[:1], names)
    target = int(logits[0, position].argmax()) if target is None else target
    norm, head = model.final_norm, model.lm_head
    u = head.weight[target].detach().double()  # (D,)
    outputs = {}  # each sublayer's output and, in a sandwich block, its outer norm frozen at that output
    for i, block in enumerate(blocks):
        for part, name, sub_norm in (("attn", "attn.out", block.attn_norm), ("ffn", "ffn.post", block.ffn_norm)):
            out = cache[f"blocks.{i}.{name}"][0, position].double()
            outputs[i, part] = (out, frozen(sub_norm.outer, out) if sandwich[i] else (lambda v: v, 0.0))
    final = sum([cache["embed"][0, position].double()] +
                [f(out) + shift for out, (f, shift) in outputs.values()])
    apply_final, final_shift = frozen(norm, final)
    constant = float(final_shift @ u) if torch.is_tensor(final_shift) else 0.0

    def term(vector: Tensor, through=lambda v: v) -> float:  # frozen norms and the head's row on one component
        return float(apply_final(through(vector.double())) @ u)

    components = [("embed", term(cache["embed"][0, position]))]
    for i, block in enumerate(blocks):
        attn = block.attn
        through, shift = outputs[i, "attn"][1]
        z = cache[f"blocks.{i}.attn.z"][0, :, position].double()  # (H, Dh) (latent attention: (H, d_V))
        w_o = attn.o_proj.weight.detach().double()  # (D, H*Dh)
        width = z.shape[-1]
        for h in range(attn.n_heads):
            out_h = w_o[:, h * width:(h + 1) * width] @ z[h]  # (D,)
            components.append((f"blocks.{i}.attn.head{h}", term(out_h, through)))
        if attn.o_proj.bias is not None:
            components.append((f"blocks.{i}.attn.bias", term(attn.o_proj.bias.detach(), through)))
        constant += term(shift) if torch.is_tensor(shift) else 0.0
        through, shift = outputs[i, "ffn"][1]
        components.append((f"blocks.{i}.ffn", term(cache[f"blocks.{i}.ffn.post"][0, position], through)))
        constant += term(shift) if torch.is_tensor(shift) else 0.0
    if head.bias is not None:
        constant += float(head.bias[target])
    return {"target": target, "logit": float(logits[0, position, target]), "constant": constant,
            "components": components}


def frozen(norm: nn.Module, whole: Tensor):
    """(the norm as a linear map with its statistics frozen at `whole`, its bias or 0): LayerNorm
    v -> gain (v - mean v) / sigma(whole), RMSNorm v -> gain v / rms(whole)."""
    gain = norm.weight.detach().double()
    if isinstance(norm, LayerNorm):
        scale = 1.0 / torch.sqrt(whole.var(unbiased=False) + norm.eps)
        bias = norm.bias.detach().double() if norm.bias is not None else 0.0
        return (lambda v: (v - v.mean()) * scale * gain), bias
    scale = 1.0 / torch.sqrt((whole ** 2).mean() + norm.eps)
    return (lambda v: v * scale * gain), 0.0


def steering_vector(model: nn.Module, plus: Tensor, minus: Tensor, layer: int) -> Tensor:
    """The difference of two prompts' mean residual streams leaving block `layer` (Turner et al. 2023's
    activation addition): mean_t resid_post(plus) - mean_t resid_post(minus), (D,)."""
    if not 0 <= layer < len(model.blocks):
        raise QkvError(f"layer {layer} is not in 0..{len(model.blocks) - 1}")
    name = f"blocks.{layer}.resid_post"
    means = [run_with_cache(model, ids[:1], [name])[1][name][0].float().mean(0) for ids in (plus, minus)]
    return means[0] - means[1]


def steer(vector: Tensor, scale: float = 1.0) -> Hook:
    """A hook adding scale x vector to a residual-stream point at every position (and every decoding step)."""
    def hook(x: Tensor, name: str) -> Tensor:
        return x + (scale * vector).to(x.dtype)
    return hook


def patching_map(model: nn.Module, clean: Tensor, corrupted: Tensor, *, answer: int, wrong: int) -> dict:
    """Activation patching of the residual stream (Meng et al. 2022; Wang et al. 2022's logit difference): for
    every block l and position t, run the corrupted prompt with resid_pre of block l at t taken from the clean
    run, and measure how much of the logit difference logit(answer) - logit(wrong) at the last position comes
    back: (patched - corrupted) / (clean - corrupted). Row L is the last block's resid_post, at which the last
    position alone gives everything back (1.0), as it is all the head reads. Prompts of one length."""
    layers = len(model.blocks)
    names = [f"blocks.{i}.resid_pre" for i in range(layers)] + [f"blocks.{layers - 1}.resid_post"]
    cache, recovered, (low, high) = _patching(model, clean, corrupted, names, answer, wrong)
    rows = [[recovered([(name, patch_from(cache, [t]))]) for t in range(clean.shape[-1])] for name in names]
    return {"points": names, "recovered": rows, "clean": high, "corrupted": low}


def _patching(model: nn.Module, clean: Tensor, corrupted: Tensor, names: list[str], answer: int, wrong: int):
    """What every patching map shares: the clean run's cache of `names`, a function giving the share of the logit
    difference logit(answer) - logit(wrong) at the last position that the corrupted run with some hooks gives
    back, and (corrupted, clean) differences."""
    if clean.shape != corrupted.shape:
        raise QkvError(f"patching needs prompts of one length in tokens: {clean.shape[-1]} and {corrupted.shape[-1]}")

    def difference(logits: Tensor) -> float:
        return float(logits[0, -1, answer] - logits[0, -1, wrong])

    clean_logits, cache = run_with_cache(model, clean[:1], names)
    low, high = difference(run_with_hooks(model, corrupted[:1], [])), difference(clean_logits)
    if abs(high - low) < 1e-9:
        raise QkvError("the clean and corrupted prompts give the same logit difference: nothing to recover")

    def recovered(hooks: list[tuple[str, Hook]]) -> float:
        return (difference(run_with_hooks(model, corrupted[:1], hooks)) - low) / (high - low)

    return cache, recovered, (low, high)


def patch_head_from(cache: dict[str, Tensor], head: int) -> Hook:
    """A hook for `blocks.{i}.attn.z` that puts one head's clean output in place of this run's, at every position."""
    def hook(z: Tensor, name: str) -> Tensor:
        z = z.clone()
        z[:, head] = cache[name][:, head].to(z.dtype)
        return z
    return hook


def mean_head(mean: Tensor, head: int) -> Hook:
    """A hook for `blocks.{i}.attn.z` that replaces one head's output by `mean` (Dh,) at every position (mean
    ablation: the head's average contribution kept, what it computes from this input removed)."""
    def hook(z: Tensor, name: str) -> Tensor:
        z = z.clone()
        z[:, head] = mean.to(z.dtype)
        return z
    return hook


def head_patching_map(model: nn.Module, clean: Tensor, corrupted: Tensor, *, answer: int, wrong: int
                      ) -> list[list[float]]:
    """For every layer and head: the corrupted run with that head's output (z, every position) from the clean
    run, and the share of the logit difference logit(answer) - logit(wrong) at the last position it gives back."""
    names = [f"blocks.{i}.attn.z" for i in range(len(model.blocks))]
    cache, recovered, _ = _patching(model, clean, corrupted, names, answer, wrong)
    return [[recovered([(name, patch_head_from(cache, h))]) for h in range(block.attn.n_heads)]
            for name, block in zip(names, model.blocks)]


def expert_routes(model: nn.Module, input_ids: Tensor) -> list[dict]:
    """Each MoE layer's routing of one sequence (batch 1), read at its `gates` point (qkv.nn.moe): per token the
    chosen experts and their gates (largest first), and per expert the share of the routes it took."""
    top_k = {f"{name}.gates": module.top_k for name, module in model.named_modules() if isinstance(module, MoE)}
    names = list(top_k)
    if not names:
        raise QkvError("the model has no mixture-of-experts layer: nothing routes")
    if input_ids.shape[0] != 1:
        raise QkvError("expert_routes reads one sequence (batch 1)")
    _, cache = run_with_cache(model, input_ids, names=names)
    layers = []
    for name in names:
        gates = cache[name][0].float()  # (T, E)
        values, experts = gates.topk(top_k[name], dim=-1)
        load = torch.bincount(experts.reshape(-1), minlength=gates.shape[-1]).float() / experts.numel()
        layers.append({"point": name, "experts": experts.tolist(), "gates": values.tolist(), "load": load.tolist()})
    return layers
