"""The products of qkv.nn.quant's int8g layers (a GGUF file's 5-, 6- and 8-bit blocks as shipped:
qkv.formats.gguf.blocks): W_ij = s_ig q_ij + m_ig by groups g of 32 or 16 inputs, the codes held group by group
(G, out, g); and the few-row products of its int4 layers by grouped.c's loops."""
from __future__ import annotations

import ctypes

import torch
from torch import Tensor

from qkv.nn import forms, native


def dequantize_grouped(codes: Tensor, scale: Tensor, low: Tensor | None, dtype: torch.dtype = torch.float32) -> Tensor:
    """int8g (and int4's unpacked codes): W = s q + m by groups, in `dtype`."""
    n, k = codes.shape
    groups = scale.shape[1]
    w = codes.to(dtype).view(n, groups, k // groups) * scale.to(dtype)[..., None]
    if low is not None:
        w = w + low.to(dtype)[..., None]
    return w.view(n, k)


def grouped_product(flat: Tensor, codes: Tensor, scale_t: Tensor, low: Tensor | None, ones: Tensor) -> Tensor:
    """int8g's x W^T for a few bf16 rows flat (M, K): y = sum_g s_g (x_g q_g^T) + sum_g m_g sum_{j in g} x_j,
    each group's x_g q_g^T by torch's int8 kernel (unit scales: its bf16 rounding of one group's sum), weighed
    by the fp32 scales s_g (G, N). Against dequantizing W for each call (`python benchmarks/int8g_rows.py`,
    2026-12-07, 2-core AMD EPYC with avx512_bf16, one row): SmolLM2's 49,152 x 576 Q8_0 head 3.1 ms against
    57 (its bf16 head 5.4), Gemma 3's 2,048 x 640 Q5_0 0.3 against 0.7. Big matrices and several rows accumulate
    group by group (the head 3.1 ms against 4.8 stacked), one row of a small one stacks the groups' products and
    weighs them in one sum. The weighing of G products (M, N) (2026-12-07, 2-core AMD EPYC with AVX2 only, ms):
    accumulated 0.23 and 1.0 for Gemma's 20 x (8, 2,048) and 128 x (8, 640), against 0.96 and 5.8 as one einsum
    (a batched product over N); for one row, stacked 0.05 and 0.07 against 0.15 and 0.85 accumulated."""
    groups, n, g = codes.shape
    xs = flat.view(-1, groups, g).transpose(0, 1).contiguous()  # (G, M, g)
    if n >= 16384 or flat.shape[0] > 1:
        y = torch.zeros(flat.shape[0], n)
        for i in range(groups):
            y.addcmul_(torch._weight_int8pack_mm(xs[i], codes[i], ones), scale_t[i])
    else:
        parts = torch.stack([torch._weight_int8pack_mm(xs[i], codes[i], ones) for i in range(groups)])  # (G, 1, N)
        y = (parts.float() * scale_t[:, None]).sum(0)
    if low is not None:
        y = y + xs.float().sum(-1).t() @ low.t()  # (M, G) (G, N)
    return y.to(flat.dtype)


@torch.library.custom_op("qkv::grouped_product", mutates_args=())
def grouped_op(flat: Tensor, codes: Tensor, scale_t: Tensor, low: Tensor | None, ones: Tensor) -> Tensor:
    """grouped_product as one operator: a compiled graph calls it once, where tracing its loop would put G
    kernel calls a layer into the graph's code (Gemma 3: 2,000 of them)."""
    return grouped_product(flat, codes, scale_t, low, ones)


@grouped_op.register_fake
def _(flat: Tensor, codes: Tensor, scale_t: Tensor, low: Tensor | None, ones: Tensor) -> Tensor:
    return flat.new_empty(flat.shape[0], codes.shape[1])


POINTER, NUMBER, WIDE = ctypes.c_void_p, ctypes.c_int, ctypes.c_long  # grouped.c's argument types


def loops(name: str, argtypes: list):
    """grouped.c's function `name` built for this machine (qkv.nn.native) with its argument types, or None."""
    lib = native.library("grouped")
    if lib is None:
        return None
    function = getattr(lib, name)
    if function.argtypes is None:
        function.argtypes, function.restype = argtypes, None
    return function


def native_kernel():
    """grouped.c's qkv_grouped_rows, or None."""
    return loops("qkv_grouped_rows", [POINTER, POINTER, NUMBER, NUMBER, POINTER, WIDE, WIDE, NUMBER, NUMBER, NUMBER,
                                      POINTER, WIDE, WIDE, POINTER, WIDE, WIDE, POINTER, NUMBER, NUMBER])


def native_rows() -> bool:
    """Whether int8g's products under DENSE_PROMPT positions a row take grouped.c's loops (native_product, fp32
    rows) on this machine: where they are built and measured the faster than torch's int8 kernel group by group
    (forms.measure_native)."""
    if native_kernel() is None:
        return False
    return bool(forms.choice("native_int8g", lambda: forms.measure_native(native_product, grouped_product)))


def narrow_rows() -> bool:
    """Whether grouped.c's loops (native_rows) round a prompt's rows to int16 by groups first (native_product's
    `narrow`) on this machine: where measured the faster than the rows in fp32 (forms.measure_narrow). A
    decoding step's rows stay fp32: its one-row products are bound by reading the weights, the compiled step
    of Gemma 3 no faster with them narrow (2026-12-07, the AVX2-only EPYC: 21.9 against 21.6 ms a token, within
    the host's noise), and they keep the file's exact products (1.5e-6 of Gemma's largest logit from the file
    dequantized to fp32, 1.3-1.5e-4 narrow; KL 4e-8, the top token the same). Gemma 3's prompt eagerly (its 136
    int8g layers, medians of 9 alternating): 7 tokens 70 -> 60 ms, 20 tokens 140 -> 117 ms."""
    if not native_rows():
        return False
    return bool(forms.choice("narrow_int8g", lambda: forms.measure_narrow(native_product)))


def grouped_layout(codes: Tensor) -> Tensor:
    """int8g's codes (G, N, g) (or scales (G, N)) as the layer holds them: where grouped.c's loops take its rows
    (native_rows), a view of (N, G, g) storage, each output row's codes one run of memory (Gemma 3's one-row head
    21 ms against 40 for the planes, 2026-12-07, the AVX2-only EPYC: the loops read one stream, not G; its
    scales so too, 13 against 14); elsewhere each group's plane (N, g) contiguous, as torch's int8 kernel takes
    it."""
    if native_rows():
        return codes if codes.transpose(0, 1).is_contiguous() else codes.transpose(0, 1).contiguous().transpose(0, 1)
    return codes.contiguous()


def native_product(flat: Tensor, codes: Tensor, scale_t: Tensor, low: Tensor | None, narrow: bool = False) -> Tensor:
    """int8g's x W^T for rows flat (M, K) by grouped.c's loops, in fp32 throughout: each group's sum of
    products, then the groups' sums weighed by their scales (y (M, N) fp32); `narrow`: each group of a row
    rounded to int16 first, its products summed as integers (grouped.c's header: |error| <= sum_g |s_g| t_g / 2
    sum_j |q_j|, t_g = max_j |x_j| / 32,767; with AVX2, groups of a multiple of 16). The codes (G, N, g) (inner stride
    1), scales (G, N) fp32 and minima (N, G) may be views (grouped_layout: a row's codes and scales together).
    One row, 2026-12-07, the 2-core AMD EPYC with AVX2 only
    (no native bf16), medians against grouped_product with a bf16 row: Gemma 3's gate/up 2,048 x 640 (Q5_0)
    0.07 ms against 0.53, down 640 x 2,048 (Q6_K) 0.13 against 1.65, its 262,144 x 640 Q8_0 head 24.6 against
    27.1 with one accumulator a row and the scales group by group; with two accumulators, the codes asked for
    ahead and the scales row by row (grouped.c), 12 ms (the head's bytes read at about 15 GB/s)."""
    groups, n, g = codes.shape
    x = flat.float().contiguous()
    rows = x.shape[0]
    assert codes.dtype == torch.int8 and codes.stride(2) == 1 and x.shape[1] == groups * g
    xsum = x.view(rows, groups, g).sum(-1).contiguous() if low is not None else None
    low, scale_t = (low.float() if low is not None else None), scale_t.float()  # (held: their pointers are used)
    y = torch.empty(rows, n)
    native_kernel()(x.data_ptr(), None if xsum is None else xsum.data_ptr(), rows, x.shape[1], codes.data_ptr(),
                    codes.stride(0), codes.stride(1), groups, n, g, scale_t.data_ptr(), scale_t.stride(0),
                    scale_t.stride(1), None if low is None else low.data_ptr(), 0 if low is None else low.stride(0),
                    0 if low is None else low.stride(1), y.data_ptr(), int(narrow), torch.get_num_threads())
    return y


@torch.library.custom_op("qkv::native_grouped", mutates_args=())
def native_op(flat: Tensor, codes: Tensor, scale_t: Tensor, low: Tensor | None, narrow: bool) -> Tensor:
    """native_product as one operator: what a compiled graph calls."""
    return native_product(flat, codes, scale_t, low, narrow)


@native_op.register_fake
def _(flat: Tensor, codes: Tensor, scale_t: Tensor, low: Tensor | None, narrow: bool) -> Tensor:
    return flat.new_empty(flat.shape[0], codes.shape[1], dtype=torch.float32)


def native_grouped(flat: Tensor, codes: Tensor, scale_t: Tensor, low: Tensor | None, narrow: bool) -> Tensor:
    """native_product, as one operator where torch.compile traces it (native_op)."""
    return (native_op if torch.compiler.is_compiling() else native_product)(flat, codes, scale_t, low, narrow)


INT4_ARGTYPES = [POINTER, NUMBER, NUMBER, POINTER, NUMBER, POINTER, POINTER, POINTER, NUMBER]  # qkv_int4_rows's


def native_int4_kernel():
    """grouped.c's qkv_int4_rows, or None."""
    return loops("qkv_int4_rows", INT4_ARGTYPES)


def native_int4() -> bool:
    """Whether int4's products under DENSE_PROMPT positions a row take grouped.c's loops (native_int4_product,
    fp32 rows) on this machine: where they are built and measured the faster than torch's int4 kernel with bf16
    rows (forms.measure_native_int4)."""
    if native_int4_kernel() is None:
        return False
    return bool(forms.choice("native_int4", lambda: forms.measure_native_int4(native_int4_product)))


def native_int4_product(flat: Tensor, packed: Tensor, scale: Tensor, low: Tensor) -> Tensor:
    """int4's x W^T for rows flat (M, K) by grouped.c's loops, in fp32 throughout (y (M, N) fp32): the codes two
    a byte (N, K / 2) as qkv.nn.quant.pack_nibbles lays them, scales and minima (N, K / 32) fp32. One row,
    2026-12-07, the 2-core AMD EPYC with AVX2 only, against torch's int4 kernel with a bf16 row (the form it
    took before): SmolLM2's 1,536 x 576 50 us against 124, its 49,152 x 576 head 1.4 ms against 2.4."""
    x = flat if flat.dtype == torch.float32 and flat.is_contiguous() else flat.float().contiguous()
    (rows, k), n = x.shape, packed.shape[0]
    assert packed.dtype == torch.uint8 and packed.is_contiguous() and packed.shape[1] * 2 == k and k % 32 == 0
    assert scale.dtype == low.dtype == torch.float32 and scale.is_contiguous() and low.is_contiguous()
    y = torch.empty(rows, n)
    native_int4_kernel()(x.data_ptr(), rows, k, packed.data_ptr(), n, scale.data_ptr(), low.data_ptr(), y.data_ptr(),
                         torch.get_num_threads())
    return y


@torch.library.custom_op("qkv::native_int4", mutates_args=())
def native_int4_op(flat: Tensor, packed: Tensor, scale: Tensor, low: Tensor) -> Tensor:
    """native_int4_product as one operator: what a compiled graph calls."""
    return native_int4_product(flat, packed, scale, low)


@native_int4_op.register_fake
def _(flat: Tensor, packed: Tensor, scale: Tensor, low: Tensor) -> Tensor:
    return flat.new_empty(flat.shape[0], packed.shape[0], dtype=torch.float32)


def native_int4_grouped(flat: Tensor, packed: Tensor, scale: Tensor, low: Tensor) -> Tensor:
    """native_int4_product, as one operator where torch.compile traces it (native_int4_op)."""
    return (native_int4_op if torch.compiler.is_compiling() else native_int4_product)(flat, packed, scale, low)
