"""The products of a decoding step's few rows on CPU, in their faster forms: the linear layer DecodingLinear
(W x^T where that form is the faster), swapped in from outside for the duration of a generate call or a serving
step (qkv.nn.swap), and one row's product as a sum inductor writes (summed_product), which a compiled step's
layers take inside summing(True) (qkv.generate.compiled)."""
from __future__ import annotations

import math
import threading
import weakref
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from qkv.nn import forms
from qkv.nn.fastpath import has_hooks
from qkv.nn.swap import swapped


class DecodingLinear(nn.Module):
    """nn.Linear for a decoding step's few rows on CPU: y^T = W x^T + b, with W kept (out, in) as it is.

    A decoding step multiplies every weight matrix by a few rows (the batch, or its beams), with weights
    that do not fit in cache, so its time is the time to read W. On the AMD machines torch's CPU product
    x W^T (nn.Linear's form) reads W at 4.5-5.2 GB/s for 2-16 rows and 8.8 GB/s for one; the same product
    taken as W x^T (W on the left, x^T a transposed view) reads it at 5-11 GB/s (benchmarks/decode_kernels.py,
    one step of the benchmark GPT-2: 1 row 6.2 -> 5.4 ms, 2 rows 11.9 -> 5.4 ms, 8 rows 10.7 -> 7.2 ms; equal
    at 128 rows). One row is widened to two with a zero row: a single column falls back to a matrix-vector
    kernel as slow as nn.Linear's. More than `max_rows` rows (a long prefill) take nn.Linear's path, and so do
    all rows where W x^T is not the faster form (left_form_faster). One row of a compiled step takes
    summed_product's form where summing() says so. The parameters stay registered under the layer's own names
    (state_dict unchanged); nothing is copied.
    """

    max_rows = 64

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.weight, self.bias = linear.weight, linear.bias  # (out, in), (out,) or None
        # plain attributes as well: read on every call without nn.Module's __getattr__
        object.__setattr__(self, "w", linear.weight)
        object.__setattr__(self, "b", None if linear.bias is None else linear.bias[:, None])  # (out, 1)
        object.__setattr__(self, "left", left_form_faster(linear.weight.dtype))  # else nn.Linear's product

    def forward(self, x: Tensor) -> Tensor:  # (..., in) -> (..., out)
        if summed_rows(x, self.w):
            return summed_product(x, self.w, self.bias)
        if not self.left or math.prod(x.shape[:-1]) > self.max_rows:
            return F.linear(x, self.w, self.bias)
        return left_product(x, self.w, self.b)


def decode_rows(x: Tensor) -> bool:
    """Whether `x` (..., in) is a decode step's few rows on the CPU, outside autograd: where the W x^T form
    may be the faster one (left_form_faster)."""
    return (x.device.type == "cpu" and not torch.is_grad_enabled()
            and math.prod(x.shape[:-1]) <= DecodingLinear.max_rows)


def left_product(x: Tensor, w: Tensor, b: Tensor | None) -> Tensor:
    """x W^T + b taken as (b + W x^T)^T: x (..., in), W (out, in), b (out, 1) or None; row-major (..., out)."""
    flat = x.reshape(-1, x.shape[-1])  # (rows, in)
    rows = flat.shape[0]
    if rows == 1:
        flat = torch.cat((flat, torch.zeros_like(flat)))  # (2, in)
    y = torch.mm(w, flat.t()) if b is None else torch.addmm(b, w, flat.t())  # (out, rows)
    return y[:, :rows].t().contiguous().view(*x.shape[:-1], y.shape[0])  # row-major, as F.linear's


# set by summing() around a compiled step's call, on its thread only: torch.compiler.is_compiling() is true on
# every thread while one traces, and an eager step beside a background compile (qkv.generate.background) that
# took the sum form built the (out, in) product: SmolLM2's 24 tokens in 5 s instead of 0.5
_summing = threading.local()
# A short prompt's rows of fp32 weights take the sum form too (summed_product): SmolLM2's 30 layers on the AMD
# EPYC at 2 / 6 / 12 rows in 12.5 / 20.4 / 47.9 ms against W x^T's 14.7 / 33.5 / 62.7; bf16 and int8 rows not
# (`python benchmarks/one_row_products.py --rows 6`: fp32 20.1 against 31.9, bf16 22.1 against 20.0, int8 20.7
# against 19.2 by torch's kernels; docs/real-models.md, 2026-12-05).
SUMMED_ROWS = 16


@contextmanager
def summing(on: bool | frozenset):
    """Products of one row traced by torch.compile take summed_product's form for the duration where their
    weights' dtype is in `on` (True: every dtype, False: none), torch's kernels elsewhere (qkv.generate.compiled's
    step: on for summed_dtypes())."""
    on = frozenset(SUMMED_DTYPES if on is True else () if on is False else on)
    if on:
        inductor_prims()
    before, _summing.on = getattr(_summing, "on", frozenset()), on
    inside, _summing.inside = getattr(_summing, "inside", False), True
    try:
        yield
    finally:
        _summing.on, _summing.inside = before, inside


def traced_here() -> bool:
    """Whether this thread is tracing a compiled step's call (inside summing(), on or off, while torch.compile
    traces): what is traced becomes the graph's code, so a product taken as a Python loop of G kernel calls
    would be G calls in it (a Gemma 3 graph of 2.3 MB of C++, compiled in more than 10 minutes)."""
    return getattr(_summing, "inside", False) and torch.compiler.is_compiling()


def summed_rows(x: Tensor, w: Tensor | None = None) -> bool:
    """Whether `x` (..., in) is one row of a decoding step that torch.compile is tracing on the CPU inside
    summing() with the dtype of its weights `w` (or of `x` itself: attention) on, or up to SUMMED_ROWS rows of a
    short prompt by fp32 weights: the products that take summed_product's form."""
    if not (torch.compiler.is_compiling() and x.device.type == "cpu" and not torch.is_grad_enabled()
            and (w if w is not None else x).dtype in getattr(_summing, "on", ())):
        return False
    rows = math.prod(x.shape[:-1])
    return rows == 1 or (w is not None and w.dtype == x.dtype == torch.float32 and rows <= SUMMED_ROWS)


def summed_product(x: Tensor, w: Tensor, b: Tensor | None = None, scale: Tensor | None = None) -> Tensor:
    """y_i = s_i sum_j W_ij x_j + b_i for one row x (..., in) (or a few: summed_rows): W (out, in) in x's dtype
    or int8 codes, s (out,) per-row scales or None, b (out,) or None; summed in fp32, y in x's dtype (rounded
    once, at the end, as torch's bf16 and int8 kernels round theirs).

    Written as a product of broadcast tensors and a sum over j, for inductor to turn into one loop per output
    row that reads each W_ij once, converts it to fp32 and accumulates in fp32 (the multiply and the
    conversion fused into the sum: nothing (out, in) is ever stored). Only inside a compiled graph (eagerly
    it would build the (out, in) product). Why: on CPUs without AMX torch's kernels for one row read a decode
    step's matrices slowly; on the 2-core AMD EPYC with avx512_bf16 (2 threads, SmolLM2-135M's 30 layers of
    Q/K/V, W^O, gate/up and down matrices, 106 M weights, benchmarks/one_row_products.py, 2026-12-05) this
    form reads them in 9.2 ms at fp32 (torch's W x^T 12.8), 7.1 ms at bf16 (torch's x W^T 15.8), 5.5 ms at
    int8 (torch._weight_int8pack_mm 12.0), and the 49,152 x 576 bf16 head in 1.6 ms (3.4; fp32 3.2 both)."""
    rows = math.prod(x.shape[:-1])
    if rows == 1:
        flat = stored(x.reshape(1, x.shape[-1]).float())
        y = (w.float() * flat).sum(-1)  # (out,): sum_j W_ij x_j
    else:  # a loop per output row i over the rows, W's row i read from memory once for all of them; both the
        # rows and y row-major (x as it comes may be the previous sum's transpose: inductor then vectorizes
        # over the few rows instead of j)
        flat = stored(x.reshape(rows, x.shape[-1]).float().contiguous())
        y = (w.float()[:, None, :] * flat[None]).sum(-1).t().contiguous()  # (rows, out)
    if scale is not None:
        y = y * scale.float()
    if b is not None:
        y = y + b.float()
    return y.to(x.dtype).reshape(*x.shape[:-1], w.shape[0])  # (a row-major copy where rows > 1)


def summed_grouped_product(x: Tensor, codes: Tensor, scale_t: Tensor, low: Tensor | None) -> Tensor:
    """y_i = sum_g s_ig sum_{j in g} q_ij x_j + sum_g m_ig sum_{j in g} x_j for one row x (..., in): codes
    q (G, out, g) int8 group by group, s^T (G, out) and m (out, G) fp32 (qkv.nn.quant's int8g); summed in fp32
    as summed_product, the codes converted inside inductor's loop, y in x's dtype."""
    groups, n, g = codes.shape
    flat = stored(x.reshape(1, groups * g).float()).view(groups, 1, g)
    y = ((codes.float() * flat).sum(-1) * scale_t).sum(0)  # (out,)
    if low is not None:
        y = y + (low * flat.view(1, groups, g).sum(-1)).sum(-1)
    return y.to(x.dtype).reshape(*x.shape[:-1], n)


def stored(row: Tensor) -> Tensor:
    """`row` as a tensor inductor writes to memory before the sum reads it: left to itself, inductor computes
    whatever made the row (a norm, a residual sum, the roundings) again inside the sum's loop, once per output
    row (SmolLM2's bf16 head with its norm so: 10.6 ms against 1.6). inductor's own prim for a tensor's layout
    does it (it copies a value not yet in memory; registered by inductor_prims(), which summing(True) calls
    before anything is traced); without it, the row as it is."""
    force = getattr(torch.ops.prims, "inductor_force_stride_order", None)
    return row if force is None else force(row, row.stride())


def inductor_prims() -> None:
    """Register inductor's prims (torch.ops.prims.inductor_*; `stored` uses one): torch registers them only
    when inductor's lowering is first imported, after the first graph was traced."""
    try:
        import torch._inductor.inductor_prims  # noqa: F401
    except ImportError:
        pass


SUMMED_DTYPES = (torch.float32, torch.bfloat16, torch.int8)  # the weights summed_product takes (int8: codes)


def summed_form_faster(dtype: torch.dtype) -> bool:
    """Whether summed_product beats torch's kernels for a compiled step's one row of `dtype` weights on this CPU
    (fp32, bf16, int8 codes): measured once per machine and kept (qkv.nn.forms; it compiles a small graph, so
    ask where the step compiles). On the AMD EPYC with avx512_bf16 the sums won at all three (summed_product's
    docstring); on an AVX2-only EPYC at fp32 and bf16, not int8 (qkv.nn.forms)."""
    if dtype not in SUMMED_DTYPES:
        return False

    def measure():
        inductor_prims()
        left = dtype != torch.int8 and left_form_faster(dtype)
        rows = torch.float32 if forms.choice("quant_rows_bf16") is False else torch.bfloat16  # as QuantLinear's
        return forms.measure_summed(dtype, left, left_product, stored, int8_rows=rows)

    return forms.choice(f"summed_{FORM_NAMES[dtype]}", measure)


def summed_form_known(dtype: torch.dtype) -> bool | None:
    """summed_form_faster(dtype) where this machine has measured it, else None (nothing compiled or measured)."""
    return forms.choice(f"summed_{FORM_NAMES[dtype]}")


def summed_dtypes() -> frozenset:
    """The weight dtypes whose one-row products a compiled step takes as sums here (summing's `on`)."""
    return frozenset(dtype for dtype in SUMMED_DTYPES if summed_form_faster(dtype))


FORM_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.int8: "int8"}


@contextmanager
def decoding_linears(model: nn.Module):
    """Swap every nn.Linear of a CPU model for a DecodingLinear for the duration; put them back afterwards.

    Layers with hooks (their hooks must run), DTensor shards (tensor parallel) and CUDA weights keep nn.Linear.
    """
    with swapped(model, stands_in_for, decoding_linear):
        yield model


_made: "weakref.WeakKeyDictionary[nn.Linear, DecodingLinear]" = weakref.WeakKeyDictionary()


def decoding_linear(linear: nn.Linear) -> DecodingLinear:
    """The DecodingLinear standing in for `linear`, made once and kept while `linear` lives (and holds the same
    weight and bias): building 200 of them for every generate call was 3 ms of a short prompt's prefill."""
    made = _made.get(linear)
    if made is None or made.w is not linear.weight or made.bias is not linear.bias:
        made = _made[linear] = DecodingLinear(linear)
    return made


def stands_in_for(name: str, module: nn.Module) -> bool:
    """A plain nn.Linear with an fp32 or bf16 CPU weight and no hooks: the layers DecodingLinear stands in for
    (with nn.Linear's own product where neither of its forms is the faster)."""
    weight = module.weight if type(module) is nn.Linear else None
    return (weight is not None and type(weight) is nn.Parameter and weight.device.type == "cpu"
            and weight.dtype in (torch.float32, torch.bfloat16) and not has_hooks(module))


def left_form_faster(dtype: torch.dtype) -> bool:
    """Whether W x^T beats nn.Linear's x W^T for a decode step's products at `dtype` on this CPU (2 threads).

    fp32: torch multiplies it on x86 with MKL, whose kernels are chosen by the CPU's vendor. On Intel its
    x W^T for one row reads W at the copy bandwidth (SmolLM2's decode matrices at 25 GB/s against 10 GB/s as
    W x^T; SmolLM2 fp32 decode 30 tok/s against 13.5; 2-core Xeon with AMX), while on AMD it reads at 4.5-9
    GB/s and W x^T at 5-11 (the class docstring). bf16 (oneDNN) is the other way round: on the AMD EPYC with
    avx512_bf16 SmolLM2's matrices read at 18.7 GB/s as x W^T against 10.6 as W x^T; on the Intel Xeon with
    AMX at 15-23 GB/s against 25-29 (its 49152 x 576 head 3.8 against 2.3 ms; SmolLM2 bf16 decode 28.7 ->
    34.0 tok/s). So each machine measures both forms once (qkv.nn.forms) and keeps the faster; every other dtype
    takes nn.Linear's."""
    if dtype not in (torch.float32, torch.bfloat16):
        return False
    return forms.choice(f"left_{FORM_NAMES[dtype]}", lambda: forms.measure_left(dtype, left_product))
