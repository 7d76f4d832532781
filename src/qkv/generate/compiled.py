"""A decoding step compiled by torch.compile: the whole token step of a decoder LM as one graph (`--compile`).

A decoding step of a small real model is mostly overhead: SmolLM2-135M at int4 spends about 5 ms of a 16 ms
step in the weight products, 2.7 ms in the head and the rest in some 2,000 small operations (norms, RoPE,
residuals, the cache writes) and the Python that calls them. The math is the model's own (note 003, 推理原理:
one new token per row, its K/V appended to the cache, attention over the cache); here it is written once more
as one function of the step's inputs that TorchDynamo can trace whole, and inductor turns into a few fused C++
kernels around torch's own product kernels, called from generated C++ (cpp_wrapper), so the step has no
per-layer Python left. Where torch's kernels read one row's weights more slowly than sums inductor generates
(measured once per machine and dtype: qkv.nn.forms) the products of one row are written as such sums too
(qkv.nn.decoding_linear.summed_product: fp32, bf16, int8 weights and the bf16 head; int4 keeps torch's kernel):

    x = E[token] (+ P)                                    (model.embed, the model's own)
    per layer:  q, k, v = norm(x) [W^Q; W^K; W^V]^T         (fused, as qkv.nn.fuse)
                q, k <- RoPE(q, k, position)              (note 003; identity for other encodings)
                K[:, :, n-1], V[:, :, n-1] = k, v          (in place, the preallocated cache of qkv.nn.cache)
                x = x + softmax(q K[:n]^T / sqrt(Dh)) V[:n] W^O
                x = x + FFN(norm(x))                       (block.ffn, the model's own)
    logits = head(norm(x))

A short prompt (2 to PROMPT_ROWS tokens a row, no padding: a generate call's or a chat turn's) is prefilled by
the same function for T tokens a row (CompiledStep.prompt: columns n - T .. n - 1 written, each token attending
up to its own column, the head on the last), a graph of its own; its fp32 products of up to 16 rows are sums
too (summed_product reads W once for all the rows). SmolLM2's 6-token prefill: fp32 54 -> 34 ms, bf16 42 -> 31.

It covers what the general step covers for pre-norm decoders with dense softmax attention (GQA, QK-norm,
biases, RoPE or an additive encoding, any FFN, any linear layer: fp32, bf16, int8, int4) on one row or a
left-padded batch (each row's own positions, its padding columns masked: `qkv serve`'s batch) with a cache
that does not roll; anything else (hooks, rolling caches, encoder-decoders, ALiBi and the relative encodings,
sparse kernels) takes the general path, so results never depend on it. The step is checked equal to the
general one (tests/generate/test_compiled.py, tests/serve/test_engine.py).

Compilation is paid once a machine: SmolLM2-135M at int4 takes 1.5-6 minutes on 2 cores the first time, about
20 s from inductor's cache (TORCHINDUCTOR_CACHE_DIR, by default ~/.cache/qkv/inductor here). generate, chat and
serve do not wait for it: the step compiles in the background and takes over when ready (qkv.generate.
background); `--compile` compiles it first, `--no-compile` (or QKV_COMPILE=0) never. Where torch.compile cannot
run (no C++ compiler, an unsupported build) the first step says why on stderr once and decoding goes on eagerly.
"""
from __future__ import annotations

import os
import sys
import types
import warnings
from pathlib import Path

import torch
import torch.fx.experimental._config as shape_config
from torch import Tensor, nn

from qkv.generate.step_attention import attend
from qkv.generate.watch import ModelWatch, hooked, kernel_operands
from qkv.models.decoder import DecoderLM
from qkv.nn.cache import KVCache, RingLayerCache
from qkv.nn.mla import LatentAttention
from qkv.nn.moe import MoE
from qkv.nn.embedding import activations_of
from qkv.nn.decoding_linear import DecodingLinear, decoding_linears, stands_in_for, summed_dtypes, summing
from qkv.nn.positional import Learned, Positional, Rotary, rotary_cos_sin
from qkv.nn.quant import QuantLinear
from qkv.nn.residual import pre_norm, sandwich_norm
from qkv.plan import RING_SPARE

# inductor's C++ code generation notes a node holding both bf16 and fp16 (it computes such a node in fp32): a
# quantized layer's bf16 output written into an fp16 KV cache (--kv-dtype fp16); nothing for a user to do
warnings.filterwarnings("ignore", message="bf16 and fp16 are mixed in the scheduler node", category=UserWarning)
DENSE_KERNELS = ("sdpa", "naive", "flash")  # softmax(q K^T / sqrt(Dh)) V over every allowed key
PROMPT_ROWS = 16  # a prompt of up to this many tokens a row is prefilled by the compiled graph (CompiledStep.prompt)
assert PROMPT_ROWS <= RING_SPARE + 1  # its columns written in place into a ring never hide a key one of them sees
# Only what varies gets a symbol when a graph is traced (rows, cache columns, n): the cache's heads and head size,
# every weight's sizes (the quantized layers' kernel operands are plain tensors, which dynamic=True would make
# symbolic) and the norms' eps (a float: symbolic under dynamic=True) are fixed. Each symbol is an argument the
# compiled step converts and guards on every call: SmolLM2-135M at int4 had some 800, about 1.8 ms of a 12.3 ms
# token (2026-12-05). Sizes equal when traced share one symbol under torch's default ("duck" shapes), and the
# graph then holds only while they stay equal: a batch of 3 rows and a 3-column cache would recompile (a minute
# or more) as the cache grows. So a batch of rows has a symbol per size (the rows, and each of the 60 cache
# tensors' columns: SmolLM2's 62); one row (a size of 1 is never a symbol) shares: every cache tensor's columns,
# always equal, are one symbol, n (an int, never duck-sized) the other: 0.2-0.4 ms of a 7-10 ms token.


def unsupported(model: nn.Module) -> str | None:
    """Why `model`'s decoding step cannot be compiled here (module docstring), or None."""
    if not isinstance(model, DecoderLM):
        return f"{type(model).__name__} models (the compiled step is for decoder-only ones)"
    if model.bigram_emb is not None:
        return "a hashed bigram embedding"
    positional = model.positional
    if positional.score_bias_kind is not None or positional.value_term:
        return f"the {type(positional).__name__} encoding (a score or value bias)"
    if not isinstance(positional, Rotary) and type(positional).rotate is not Positional.rotate:
        return f"the {type(positional).__name__} encoding"
    if getattr(positional, "long_frequencies", None) is not None:
        return "longrope (its frequencies change with the positions a step reaches)"
    for block in model.blocks:
        attn = block.attn
        if isinstance(attn, LatentAttention):
            return "latent attention (its cache holds latents: the general step decodes from them)"
        if block.cross_attn is not None or block.residual not in (pre_norm, sandwich_norm):
            return "a block other than pre-norm (or sandwich) self-attention + FFN"
        if attn.kernel_name not in DENSE_KERNELS or attn.window:
            return f"the {attn.kernel_name} attention kernel"
        if attn.positional is not None and not isinstance(attn.positional, Rotary) and (
                type(attn.positional).rotate is not Positional.rotate):
            return f"a layer's {type(attn.positional).__name__} encoding"
        if attn.sinks is not None:
            return "attention sinks"
        if isinstance(block.ffn, MoE):  # (its routes are data: each step multiplies other experts' weights)
            return "a mixture-of-experts layer"
    if hooked(model):
        return "hooks on the model (they must see their layers run)"
    return None


def inductor_cache() -> None:
    """Keep inductor's compiled kernels under ~/.cache/qkv/inductor (unless TORCHINDUCTOR_CACHE_DIR says where),
    so that a second start finds them. torch writes its own default (/tmp/torchinductor_<user>, gone at the
    next boot) into TORCHINDUCTOR_CACHE_DIR the first time anything asks for the cache's place, and importing
    TorchDynamo asks (which loading a model may do before any step is compiled): that value counts as unset."""
    chosen = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if chosen is None or chosen == torch_default_cache():
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(Path.home() / ".cache" / "qkv" / "inductor")


def torch_default_cache() -> str | None:
    """The directory torch's inductor takes for its cache when TORCHINDUCTOR_CACHE_DIR is unset (None where this
    torch does not say)."""
    try:
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir
    except ImportError:
        return None
    return os.path.abspath(default_cache_dir())


class CompiledStep:
    """`step(tokens (B,), cache)` -> (B, V) logits for the next tokens, the cache advanced by one column, as
    model(tokens[:, None], cache=cache)[:, -1] gives them; `usable(cache)` says whether it applies."""

    def __init__(self, model: nn.Module, summed: bool | frozenset | None = None, owner: nn.Module | None = None,
                 build: bool = True):
        """`owner`: the model the step decodes for where `model` is its twin (Background: the graphs traced on a
        module tree of their own, sharing the owner's tensors); usable() watches the owner. `build`: False for
        a Background, which calls build() on its own thread."""
        reason = unsupported(model)
        if reason is not None:
            raise ValueError(f"the compiled decoding step does not cover {reason}")
        self.model = model
        self.owner = model if owner is None else owner
        self.on = build  # False while a Background builds and compiles it (usable() then says no)
        self.rings = (False,) * len(model.blocks)  # whether each layer's cache is a ring, as run() finds it
        self.failed: str | None = None
        self.summed = summed
        if build:
            self.build()

    def build(self) -> None:
        """TorchDynamo's part of the step: its compiled functions and their settings. On the thread that will
        trace the graphs: a step built on the main thread and traced on another made the main thread's eager
        decoding 6x slower meanwhile (SmolLM2 int4: 110-150 ms a token against 17-19 built on the other)."""
        import torch._dynamo  # about a second to import: only a compiled step loads it

        inductor_cache()
        model, summed = self.model, self.summed
        self.watch = ModelWatch(self.owner)  # no hooks on it, its weights those the graphs hold
        # a learned table has rows for max_seq_len positions (the general step refuses the next; this one must not
        # reach it: Learned.embed's check is a data-dependent branch a compiled graph leaves out)
        self.positions = model.positional.weight.shape[0] if isinstance(model.positional, Learned) else sys.maxsize
        # one row's products as sums inductor generates (qkv.nn.decoding_linear.summed_product) or torch's kernels
        self.summed = summed_dtypes() if summed is None else summed
        # emulate_precision_casts: a bf16 value rounded as the general step rounds it, not kept in fp32 across a
        # fusion, so that the step stays the general step's (to fp32's order of sums).
        # guard_filter_fn: the graph's guards on the model's modules and weights (some 400 tensors' dtypes,
        # sizes and strides) are not checked every token: 1-2 ms of a 9-12 ms SmolLM2 int4 token (2026-12-05, AMD
        # EPYC). A model whose weights change dtype or kind after enable() (sizes are fixed by the config), are
        # set anew (qkv.generate.watch), or in training mode, takes the general step instead (usable()).
        options = {"cpp_wrapper": True, "emulate_precision_casts": True}
        skip = getattr(torch.compiler, "skip_guard_on_all_nn_modules_unsafe", None)  # (torch >= 2.8)
        if skip is not None:
            options["guard_filter_fn"] = skip
        self.signature = weights_signature(self.owner)
        # a layer that decoding_linears swaps for a DecodingLinear (generate, chat and serve decode inside it): the
        # graphs are traced with the swapped layers, so a step called outside it swaps them in for the call
        self.swappable = next((name for name, module in model.named_modules()
                               if isinstance(module, DecodingLinear) or stands_in_for(name, module)), None)
        self.compiled = torch.compile(own_code(self.forward), dynamic=True, options=options)
        # what tracing takes (a graph is traced in a step's call, whenever its guards fail), patched around each
        # call (thread-local): no duck shapes for batches (module top), floats fixed, the weights held by the
        # graphs (install_free_tensors: qkv.generate.watch). Made once: 0.1 ms a token made anew (2026-12-06).
        held = {"install_free_tensors": True} if hasattr(torch._dynamo.config, "install_free_tensors") else {}
        traced = torch._dynamo.config.patch(specialize_float=True, **held)  # (the flag: torch >= 2.5)
        self.tracing = {duck: (shape_config.patch(use_duck_shape=duck), traced) for duck in (True, False)}
        self.compiled_prompt = torch.compile(own_code(self.prompt_forward), dynamic=True, options=options)

    def usable(self, cache: KVCache) -> bool:
        if not self.on:
            if self.background is None:
                return False
            self.background.decoding()  # (the compiler waits while the model decodes eagerly)
            if not self.background.take_over(auto=True):
                return False
        return (self.failed is None and not cache.window and not torch.is_grad_enabled()
                and cache.length < min(cache.max_len, self.positions) and self.watch()
                and not self.owner.training and weights_signature(self.owner) == self.signature)

    background = None  # the qkv.generate.background.Background compiling this step, where one does

    def takes_prompt(self, ids: Tensor, attention_mask: Tensor | None, cache: KVCache) -> bool:
        """Whether prompt() applies: 2 to PROMPT_ROWS tokens a row, none of them padding."""
        T = ids.shape[1]
        return (2 <= T <= PROMPT_ROWS and self.usable(cache) and cache.length + T <= min(cache.max_len, self.positions)
                and (attention_mask is None or bool(attention_mask.all())))

    def __call__(self, tokens: Tensor, cache: KVCache) -> Tensor:
        positions = cache.open_column()  # (B,) the new tokens' positions
        return self.run(self.compiled, self.forward, tokens, positions, cache, duck=tokens.shape[0] == 1)

    def prompt(self, ids: Tensor, cache: KVCache) -> Tensor:
        """A short prompt's prefill (takes_prompt): (B, T) tokens -> (B, V) logits after the last, the cache
        advanced by T columns, as model(ids, cache=cache, logits_to_keep=1)[:, -1] gives them. A graph of its own
        (T a symbol; no duck shapes: T equal to the cache's columns when traced would tie them)."""
        positions = cache.open_columns(ids.shape[1])  # (B, T)
        return self.run(self.compiled_prompt, self.prompt_forward, ids, positions, cache, duck=False)

    def run(self, compiled, eager, tokens: Tensor, positions: Tensor, cache: KVCache, duck: bool) -> Tensor:
        import torch._dynamo

        if self.swappable is not None and type(self.model.get_submodule(self.swappable)) is nn.Linear:
            with decoding_linears(self.model):  # (its guards on the layers are skipped: it would read a
                return self.run(compiled, eager, tokens, positions, cache, duck)  # DecodingLinear's w on nn.Linear)
        keys, values = [layer.k for layer in cache.layers], [layer.v for layer in cache.layers]
        real = cache.padding  # (B, columns) True where a column holds a token (always given: one graph for
        # padded batches and unpadded ones, which matters to qkv serve, whose batch is one or the other by turns)
        for tensor in (*keys, *values):  # (B, Hkv, columns, Dh): B and columns vary
            if not hasattr(tensor, "_dynamo_static_indices"):  # (mark_static's mark) once a tensor: 0.4 ms a token
                torch._dynamo.mark_static(tensor, (1, 3))
        # the operands are made by the first product (the prompt's) and kept: marked once (a walk of the model
        # each step would cost more than it saves); ones remade later (new weights) keep the graphs already
        # compiled, whose guards check their sizes, and only a new graph would take them for variables
        if self.watch.held is None:  # no graph traced yet (made here if no product made them yet: traced, a
            for tensor in kernel_operands(self.model, make=True):  # prompt's graph would repack int4 weights
                torch._dynamo.mark_static(tensor)  # every call)
            self.watch.hold()  # the tensors the graphs will hold
        # whether each layer's cache is a ring (a sliding layer's, qkv.nn.cache): constants to the graphs (a change,
        # which only a cache of another kind brings, traces them again), the slots its tensors' static size
        self.rings = tuple(isinstance(layer, RingLayerCache) for layer in cache.layers)
        for layer in cache.layers:
            if isinstance(layer, RingLayerCache) and not hasattr(layer.k, "_qkv_ring"):
                for tensor in (layer.k, layer.v):
                    torch._dynamo.mark_static(tensor, 2)
                    tensor._qkv_ring = True
        shapes, traced = self.tracing[duck]  # (above: one row shares its columns)
        try:
            with shapes, traced, summing(self.summed):
                return compiled(tokens, positions, cache.length, keys, values, real, cache.positions)
        except Exception as error:  # noqa: BLE001 - any failure of the compiler: decode eagerly from now on
            self.failed = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
            print(f"qkv: warning: torch.compile failed ({self.failed[:200]}); decoding without the compiled step",
                  file=sys.stderr)
            return eager(tokens, positions, cache.length, keys, values, real, cache.positions)

    def forward(self, tokens: Tensor, positions: Tensor, n: int, keys: list[Tensor],
                values: list[Tensor], real: Tensor, key_positions: Tensor) -> Tensor:
        """The step (module docstring): tokens and positions (B,), n the cache's columns with this one; `real`
        (B, columns) False at a left-padded batch's padding columns, which no query may attend to;
        `key_positions` (B, columns) each column's position (a sliding layer's window)."""
        x = self.model.embed(tokens[:, None], positions[:, None])  # (B, 1, D)
        mask = real[:, None, None, :n]  # (B, 1, 1, n): the keys each row may see
        x = self.layers(x, positions[:, None], n, keys, values, mask, key_positions, real)
        return self.model.lm_head(self.model.final_norm(x))[:, 0]  # (B, V)

    def prompt_forward(self, tokens: Tensor, positions: Tensor, n: int, keys: list[Tensor],
                       values: list[Tensor], real: Tensor, key_positions: Tensor) -> Tensor:
        """forward for T tokens a row (B, T) at `positions` (B, T): columns n - T .. n - 1 written, token t
        attending to the columns up to its own (causal), the head on the last token only."""
        T = tokens.shape[1]
        x = self.model.embed(tokens, positions)  # (B, T, D)
        columns = torch.arange(n, device=tokens.device)
        own = n - T + torch.arange(T, device=tokens.device)  # (T,) the new tokens' columns
        mask = real[:, None, None, :n] & (columns <= own[:, None])  # (B, 1, T, n)
        x = self.layers(x, positions, n, keys, values, mask, key_positions, real)
        return self.model.lm_head(self.model.final_norm(x[:, -1:]))[:, 0]  # (B, V)

    def layers(self, x: Tensor, positions: Tensor, n: int, keys: list[Tensor], values: list[Tensor], mask: Tensor,
               key_positions: Tensor, real: Tensor) -> Tensor:
        """Every block on the new columns (B, T, D) at `positions` (B, T), as each layer's plan says
        (qkv.plan): its rotation (the model's, its own base, or none), its keys (all it may see under
        `mask` (B, 1, T, n), or a sliding layer's last W positions, in a ring of slots where its cache is one)
        and its residual placement."""
        model = self.model
        wide = torch.promote_types(x.dtype, torch.float32)
        ropes: dict[int, tuple[Tensor, Tensor] | None] = {}  # cos, sin (B, 1, T, Dh) of each rotation, at least fp32
        windows: dict[tuple[int, int], Tensor] = {}  # each (window, ring)'s mask (B, 1, T, n or min(n, slots))
        for block, k_all, v_all, is_ring in zip(model.blocks, keys, values, self.rings):
            attn = block.attn
            ring = k_all.shape[2] if is_ring else 0  # its slots (a static size)
            rotation = attn.positional if attn.positional is not None else model.positional
            if id(rotation) not in ropes:
                ropes[id(rotation)] = (rotary_cos_sin(positions, rotation.frequencies, rotation.attention_factor, wide)
                                       if isinstance(rotation, Rotary) else None)
            seen = mask
            if attn.sliding:
                if (attn.sliding, ring) not in windows:
                    windows[attn.sliding, ring] = window_mask(attn.sliding, ring, positions, n, mask, key_positions,
                                                              real)
                seen = windows[attn.sliding, ring]
            rope = ropes[id(rotation)]
            x = residual(block, block.attn_norm, x, lambda h: attend(attn, h, rope, k_all, v_all, n, seen, ring))
            x = residual(block, block.ffn_norm, x, block.ffn)
        return x


def window_mask(window: int, ring: int, positions: Tensor, n: int, mask: Tensor, key_positions: Tensor,
                real: Tensor) -> Tensor:
    """A sliding layer's keys: those `mask` allows whose position is within the last `window` of the query's
    (B, 1, T, n); in a ring of `ring` slots (qkv.nn.cache), slot j holds the newest column c <= n - 1 with
    c = j mod ring, seen where written, not padding, not after the query's own column, and within its window:
    (B, 1, T, min(n, ring)): slots n .. ring - 1 are not written until the ring wraps, and are not read (a short
    chat's sliding layers read n slots, not all: Gemma 3's 512, 2.8 of a 23 ms token on the AVX2-only EPYC).
    min(n, ring) stays symbolic (torch.sym_min): the graph holds before and after the ring wraps."""
    if not ring:
        return mask & (key_positions[:, None, None, :n] > positions[:, None, :, None] - window)
    T = positions.shape[1]
    slot = torch.arange(torch.sym_min(n, ring), device=positions.device)
    column = (n - 1) - torch.remainder(n - 1 - slot, ring)  # (ring,)
    held = column.clamp(min=0)
    own = n - T + torch.arange(T, device=positions.device)  # (T,) the queries' columns
    near = key_positions[:, None, None, held] > positions[:, None, :, None] - window  # (B, 1, T, ring)
    return near & real[:, None, None, held] & (column >= 0) & (column <= own[:, None])


def residual(block: nn.Module, norm: nn.Module, x: Tensor, sublayer) -> Tensor:
    """x + F(norm(x)) (pre-norm) or x + outer(F(inner(x))) (sandwich: Gemma's four norms a block)."""
    if block.residual is sandwich_norm:
        return x + norm.outer(sublayer(norm.inner(x)))
    return x + sublayer(norm(x))


def own_code(method):
    """`method` (bound) with a code object of its own. TorchDynamo keeps its compiled graphs per code object and
    tells them apart by their guards; with the guards on the model skipped (CompiledStep), two models' steps
    sharing CompiledStep.forward's code could each run the graph compiled for the other."""
    function = method.__func__
    code = function.__code__.replace(co_name=f"{function.__name__}_{id(method.__self__):x}")
    own = types.FunctionType(code, function.__globals__, code.co_name, function.__defaults__, function.__closure__)
    return types.MethodType(own, method.__self__)


def weights_signature(model: nn.Module) -> tuple:
    """What a compiled step's graph assumes of `model` beyond its config: the weights' dtype (the embedding's:
    prepare() casts every float weight with it) and the head's kind (quantize_model swaps every layer with it).
    A few attribute reads: usable() asks every token."""
    head = model.lm_head
    return activations_of(model)[0], head.kind if isinstance(head, QuantLinear) else head.weight.dtype


def next_logits(model: nn.Module, tokens: Tensor, cache: KVCache) -> Tensor:
    """(B,) newest tokens -> (B, V) logits for the next ones, the cache advanced: by the compiled step where it
    is enabled and applies, else by the model's forward."""
    step = compiled_step(model)
    if step is not None and step.usable(cache):
        return step(tokens, cache)
    return model(tokens[:, None], cache=cache)[:, -1]


def prompt_logits(model: nn.Module, ids: Tensor, cache: KVCache, attention_mask: Tensor | None = None) -> Tensor:
    """(B, T) prompt (left-padded where `attention_mask` says) -> (B, V) logits after its last column, the cache
    advanced: by the compiled graph where it is enabled and applies (CompiledStep.takes_prompt), else by the
    model's forward."""
    step = compiled_step(model)
    if step is not None and step.takes_prompt(ids, attention_mask, cache):
        return step.prompt(ids, cache)
    return model(ids, attention_mask=attention_mask, cache=cache, logits_to_keep=1)[:, -1]


def compiled_step(model: nn.Module) -> CompiledStep | None:
    """The compiled step `enable` attached to `model`, if any."""
    return model.__dict__.get("_qkv_compiled_step")


def enable(model: nn.Module, summed: bool | frozenset | None = None) -> CompiledStep:
    """Decode `model` with a compiled step from now on (generate, chat); ValueError where it does not apply.
    `summed`: one row's products as summed_product's sums (True, or the weight dtypes that do) or torch's
    kernels (False); None: this CPU's faster, by dtype."""
    step = CompiledStep(model, summed)
    object.__setattr__(model, "_qkv_compiled_step", step)  # a plain attribute: not a submodule, not saved
    return step
