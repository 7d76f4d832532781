"""Weight-only quantization for inference: int8 per output row, 4-bit per group of 32 inputs.

A decoding step multiplies every weight matrix by a few rows (note 003, 推理原理: one token at a time, the KV
cache holding the past), so its time is the time to read the weights: bytes per weight set the speed. Storing
W in fewer bits trades a bounded error for that (the products in bf16 where torch's kernels are the faster so,
measured per machine, in the activations' precision elsewhere: QuantLinear.compute_dtype):

    int8 (per output row i):       W_ij ~ s_i q_ij,              q_ij in [-127, 127],  s_i = max_j |W_ij| / 127
    int4 (per row i, group g of G consecutive inputs, asymmetric):
                                   W_ij ~ s_ig q_ij + m_ig,      q_ij in [0, 15],
                                   m_ig = min_{j in g} W_ij,     s_ig = (max_{j in g} W_ij - m_ig) / 15

so |W_ij - W^_ij| <= s_i / 2 (int8) and <= s_ig / 2 (int4): the tests check the products against these bounds.
A third kind holds a GGUF file's 5-, 6- and 8-bit blocks as shipped (qkv.formats.gguf.blocks), never made
from float weights here:

    int8g (per row i, group g of 32 or 16 inputs):  W_ij = s_ig q_ij + m_ig,   q_ij int8 as the file has it

held group by group, codes (G, out, g): under DENSE_PROMPT positions a row by qkv/nn/grouped.c's loops in fp32
where built and faster (grouped.native_product; a prompt's rows rounded to int16 by groups first where that is
the faster, grouped.narrow_rows, a decoding step's never), else bf16 rows each group's product by torch's int8 kernel
weighed by its fp32 scales (grouped_product); longer prompts, and fp32 rows, W dequantized to their dtype; one
row of a compiled step where the sums inductor writes are the faster (decoding_linear.summed_grouped_product).
The int4 layout is GGUF's Q4_1 (blocks of 32 along the input, a scale and a minimum each), so a Q4_1 file's
weights, dequantized at load, requantize to the very same codes, scales and minima: nothing is lost twice. Its
products under DENSE_PROMPT positions a row are grouped.c's loops in fp32 where built and faster
(grouped.native_int4_product). The other products are torch's CPU kernels (`torch._weight_int8pack_mm`, `torch._weight_int4pack_mm_for_cpu`, whose
form is (q - 8) s + z: z = m + 8 s here); qkv keeps its own plain layout (codes, scales, minima) in the
state dict and the kernels' packed copy beside it, rebuilt at load. An int8 product of a long prompt, or of fp32
rows, is taken as (x q^T) s by torch's dense kernel instead, the codes converted (int8_dense), and one row of a
compiled step as a sum inductor writes (qkv.nn.decoding_linear.summed_product).
"""
from __future__ import annotations

import torch
from torch import Tensor, nn

from qkv import hardware
from qkv.nn import forms
from qkv.nn.changes import changed
from qkv.nn.bf16_linear import Bf16Linear  # noqa: F401  (the head of a quantized model: made here, kind_for)
from qkv.nn.decoding_linear import summed_grouped_product, summed_product, summed_rows, traced_here
from qkv.nn.grouped import (dequantize_grouped, grouped_layout, grouped_op, grouped_product, native_grouped,
                             narrow_rows, native_int4, native_int4_grouped, native_rows)
from qkv.nn.swap import swap

QUANTS = ("none", "int8", "int4")
KINDS = ("int8", "int4", "int8g")  # QuantLinear's: the two --quant makes and GGUF's grouped 8-bit blocks
GROUP = 32  # int4: inputs per group (GGUF's block size)


def quantize_int8(weight: Tensor) -> tuple[Tensor, Tensor]:
    """(N, K) float -> codes (N, K) int8 and scales (N,) fp32, symmetric per output row."""
    w = weight.detach().float()
    scale = w.abs().amax(dim=1) / 127.0  # (N,)
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero row: any scale, codes 0
    codes = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return codes, scale


def dequantize_int8(codes: Tensor, scale: Tensor) -> Tensor:
    return codes.float() * scale[:, None]


def quantize_int4(weight: Tensor, group: int = GROUP) -> tuple[Tensor, Tensor, Tensor]:
    """(N, K) float -> codes (N, K) uint8 in [0, 15], scales (N, K / group) and minima (N, K / group), fp32."""
    n, k = weight.shape
    w = weight.detach().float().reshape(n, k // group, group)
    low, high = w.amin(dim=2), w.amax(dim=2)  # (N, K/G)
    scale = (high - low) / 15.0
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # a constant group: codes 0, the minimum
    codes = torch.round((w - low[..., None]) / scale[..., None]).clamp_(0, 15).to(torch.uint8)
    return codes.reshape(n, k), scale, low


def dequantize_int4(codes: Tensor, scale: Tensor, low: Tensor) -> Tensor:
    n, k = codes.shape
    groups = scale.shape[1]
    w = codes.float().reshape(n, groups, k // groups) * scale[..., None] + low[..., None]
    return w.reshape(n, k)


def pack_nibbles(codes: Tensor) -> Tensor:
    """(N, K) codes in [0, 15] -> (N, K / 2) bytes, column 2j in the low four bits and 2j + 1 in the high."""
    return (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8)


def unpack_nibbles(packed: Tensor) -> Tensor:
    """pack_nibbles' inverse: (N, K / 2) bytes -> (N, K) codes."""
    return torch.stack((packed & 15, packed >> 4), dim=-1).reshape(packed.shape[0], -1)


def int4_supported(weight: Tensor, group: int = GROUP) -> bool:
    """torch's CPU int4 kernel needs whole groups, an even number of inputs and outputs in multiples of 16 (its
    packing refuses others)."""
    n, k = weight.shape
    return k % group == 0 and k % 2 == 0 and n % 16 == 0


def quantizable(name: str, module: nn.Module) -> bool:
    """A linear layer that --quant and QLoRA quantize: every nn.Linear but an MoE's router (qkv.nn.moe), whose
    scores choose the experts: small (E x D), and kept exact as llama.cpp and transformers keep it."""
    return type(module) is nn.Linear and not name.endswith("router")


def quant_rows() -> torch.dtype | None:
    """bf16 where torch's weight-only kernels are the faster with bf16 rows on this machine, whatever x's dtype
    is, else None (x's dtype): measured once and kept (qkv.nn.forms.measure_rows). They read int8 at 21.5 GB/s
    with bf16 rows and 2.9 with fp32 ones, int4 at 15.3 and 0.8 (SmolLM2's decode step, 2 threads, AMD EPYC with
    avx512_bf16), and 4-7x faster with bf16 rows also on an AVX2-only EPYC without native bf16."""
    faster = forms.choice("quant_rows_bf16", lambda: forms.measure_rows(QuantLinear.from_linear))
    return torch.bfloat16 if faster else None


def dense_rows() -> torch.dtype | None:
    """fp32 where torch's dense product of a prompt's rows is the faster in fp32 than in bf16 on this machine
    (bf16 not native: emulated), else None (the rows' own dtype): measured once and kept (forms.measure_dense)."""
    return None if forms.choice("dense_bf16", forms.measure_dense) else torch.float32


class QuantLinear(nn.Module):
    """y = x W^T + b with W held quantized (int8 or int4, above); x in fp32 or bf16, y in x's dtype.
    `weight` is a property giving the dequantized matrix (for analyses that read it, not for speed)."""

    def __init__(self, kind: str, in_features: int, out_features: int, codes: Tensor, scale: Tensor,
                 low: Tensor | None, bias: Tensor | None):
        super().__init__()
        if kind not in KINDS:
            raise ValueError(f"QuantLinear kind {kind!r}: {', '.join(KINDS)}")
        self.kind, self.in_features, self.out_features = kind, in_features, out_features
        self.register_buffer("codes", codes)
        self.register_buffer("scale", scale)
        self.register_buffer("low", low)
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)
        self._kernel: dict[torch.dtype, tuple[Tensor, ...]] = {}
        self.compute_dtype: torch.dtype | None = quant_rows()  # the products' precision on the CPU (None: x's)
        self.dense_dtype: torch.dtype | None = dense_rows()  # the dense form's (None: the rows')
        # short forwards by grouped.c's loops (in fp32) where built and faster here
        self.native = native_rows() if kind == "int8g" else kind == "int4" and native_int4()
        # and a prompt's rows (not a decoding step's) rounded to int16 first where that is faster here (grouped)
        self.narrow = kind == "int8g" and self.native and narrow_rows()

    @classmethod
    def empty(cls, kind: str, in_features: int, out_features: int, bias: bool, group: int = GROUP) -> "QuantLinear":
        """A layer of the right shapes with zero codes: for a state dict of saved codes to be loaded into."""
        if kind == "int8":
            codes, scale, low = torch.zeros(out_features, in_features, dtype=torch.int8), torch.ones(out_features), None
        else:
            groups = in_features // group
            codes = torch.zeros(out_features, in_features // 2, dtype=torch.uint8)
            scale, low = torch.ones(out_features, groups), torch.zeros(out_features, groups)
        return cls(kind, in_features, out_features, codes, scale, low, torch.zeros(out_features) if bias else None)

    @classmethod
    def from_linear(cls, linear: nn.Linear, kind: str, group: int = GROUP) -> "QuantLinear":
        w = linear.weight
        if kind == "int8":
            codes, scale = quantize_int8(w)
            low = None
        else:
            codes, scale, low = quantize_int4(w, group)
            codes = pack_nibbles(codes)  # two codes a byte: 0.5 bytes a weight (+ the scale and minimum)
        return cls(kind, w.shape[1], w.shape[0], codes, scale, low, linear.bias)

    @classmethod
    def from_codes(cls, codes: Tensor, scale: Tensor, low: Tensor | None, bias: Tensor | None,
                   kind: str = "int8g") -> "QuantLinear":
        """A layer holding given codes (N, K) (int4: uint8 in [0, 15], by groups of 32; int8g: or (N, K / G, G)),
        scales and minima (N, K / G): a GGUF file's blocks as shipped (qkv.formats.gguf.blocks). int4 codes
        whose shape the int4 kernel cannot take are held as int8g."""
        n, k = codes.shape[0], codes[0].numel()
        if kind == "int4" and (k % 2 or n % 16 or scale.shape[1] * GROUP != k or low is None):
            kind, codes = "int8g", codes.to(torch.int8)
        if kind == "int4":
            codes = pack_nibbles(codes)
        else:  # (G, N, g): each group's (N, g) contiguous for torch's int8 kernel, or a view of (N, G, g) rows
            codes = grouped_layout(codes.reshape(n, scale.shape[1], -1).transpose(0, 1))  # for grouped.c's loops
        return cls(kind, k, n, codes, scale.float(), None if low is None else low.float(), bias)

    @torch.no_grad()
    def set_weight(self, weight: Tensor) -> None:
        """Quantize `weight` (N, K) into this layer's codes, scales (and minima): a frozen base taking its values."""
        if self.kind == "int8":
            codes, scale = quantize_int8(weight)
        else:
            codes, scale, low = quantize_int4(weight, self.group)
            codes = pack_nibbles(codes)
            self.low.copy_(low)
        self.codes.copy_(codes)
        self.scale.copy_(scale)
        self._state_changed()

    @property
    def group(self) -> int:
        return self.in_features // self.scale.shape[1] if self.kind != "int8" else self.in_features

    @property
    def weight(self) -> Tensor:
        if self.kind == "int8":
            return dequantize_int8(self.codes, self.scale)
        if self.kind == "int8g":
            return dequantize_grouped(self.codes.transpose(0, 1).reshape(self.out_features, -1), self.scale, self.low)
        return dequantize_int4(unpack_nibbles(self.codes), self.scale, self.low)

    def _state_changed(self) -> None:
        self._kernel.clear()
        changed()  # (a compiled step holding the dropped operands must not run on: qkv.nn.changes)

    def _load_from_state_dict(self, *args, **kwargs):  # new codes: the kernels' copies are stale
        super()._load_from_state_dict(*args, **kwargs)
        self._state_changed()

    def kernel_cache(self) -> dict[torch.dtype, tuple[Tensor, ...]]:
        """The kernels' operands made so far, by activation dtype (kernel_operands)."""
        return self._kernel

    def kernel_operands(self, dtype: torch.dtype) -> tuple[Tensor, ...]:
        """The kernel's operands for activations of `dtype`, made once and kept."""
        found = self._kernel.get(dtype)
        if found is None:
            if self.kind == "int8":
                found = (self.codes, self.scale.to(dtype))
            elif self.kind == "int8g":  # the scales fp32 (G, N), row by row for the loops: weighed in fp32
                scale_t = self.scale.t() if self.native else self.scale.t().contiguous()
                found = (self.codes, scale_t, self.low, torch.ones(self.out_features, dtype=dtype))
            else:
                codes = unpack_nibbles(self.codes).to(torch.int32)
                packed = torch._convert_weight_to_int4pack_for_cpu(codes, 1)  # the kernel's own blocked layout
                zero = self.low + 8.0 * self.scale  # (q - 8) s + z = q s + m
                scales_and_zeros = torch.stack((self.scale.t(), zero.t()), dim=-1).contiguous()  # (K/G, N, 2)
                found = (packed, scales_and_zeros.to(dtype))
            self._kernel[dtype] = found
        return found

    def forward(self, x: Tensor) -> Tensor:  # (..., in) -> (..., out)
        flat = x.reshape(-1, self.in_features)
        native = self.native and x.device.type == "cpu" and not dense_prompt(x.shape[-2] if x.dim() > 2 else len(flat))
        compute = (self.compute_dtype if x.device.type == "cpu" and not native else None) or x.dtype  # (native: x's)
        flat = (flat.to(compute) if flat.dtype != compute else flat).contiguous()  # (to() keeps a view's strides)
        dense = int8_dense(x, flat.dtype)
        y = (QuantProduct.apply(flat, self, dense) if flat.requires_grad and torch.is_grad_enabled()
             else self.product(flat, dense, native, native and self.narrow and x.dim() > 2 and x.shape[-2] > 1))
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        out_dtype = x.dtype  # under autocast, what nn.Linear would give (bf16): no fp32 copy of each output
        if torch.is_autocast_enabled(x.device.type) and x.dtype == torch.float32:
            out_dtype = torch.get_autocast_dtype(x.device.type)
        return y.to(out_dtype).view(*x.shape[:-1], self.out_features)

    def product(self, flat: Tensor, dense: bool = False, native: bool = False, narrow: bool = False) -> Tensor:
        """flat (M, in) W^T by the weight-only kernel, in flat's dtype (int8 with `dense`: (x q^T) s by torch's
        dense kernel, int8_dense). torch's kernels for these layouts are CPU ones: on another device the layer's W
        is dequantized for the product and dropped after it (the codes are what stays in memory, as for QLoRA's
        frozen base). int8g and int4 with `native`: grouped.c's loops, each row alone in fp32 (forward); int8g's
        rows rounded to int16 by groups first with `narrow` (a prompt's: grouped.narrow_rows)."""
        if flat.device.type != "cpu":
            return flat @ self.weight.to(flat.dtype).t()
        if native and self.kind == "int4":  # (each row alone, as for int8g below)
            return native_int4_grouped(flat, self.codes, self.scale, self.low).to(flat.dtype)
        operands = self.kernel_operands(flat.dtype)
        if self.kind == "int8g":
            codes, scale_t, low, ones = operands
            if summed_rows(flat, codes):  # a compiled step's one row where int8's sums are the faster here
                return summed_grouped_product(flat, codes, scale_t, low)
            if native:  # (a row's product the same whatever rows beside it: as alone in a server's batch)
                return native_grouped(flat, codes, scale_t, low, narrow).to(flat.dtype)
            traced = traced_here()  # a compiled graph: one bf16 row as one operator, more rows W dequantized
            if dense or flat.dtype != torch.bfloat16 or (traced and flat.shape[0] > 1) or not codes.is_contiguous():
                return self.dense_product(flat, self.weight)
            return (grouped_op if traced else grouped_product)(flat, codes, scale_t, low, ones)
        if self.kind == "int8":
            codes, scale = operands  # (the scales in flat's dtype: the kernel's rounding)
            if summed_rows(flat, codes):  # a compiled step's one row, as a sum inductor writes (decoding_linear)
                return summed_product(flat, codes, scale=scale)
            if dense or self.in_features % INT8_KERNEL_K:  # q_ij exact in bf16 and fp32 (|q| <= 127)
                return self.dense_product(flat, codes).mul_(scale)  # (x q^T) s
            return torch._weight_int8pack_mm(flat, codes, scale)
        packed, scales_and_zeros = operands
        return torch._weight_int4pack_mm_for_cpu(flat, packed, self.group, scales_and_zeros)

    def dense_product(self, flat: Tensor, w: Tensor) -> Tensor:
        """flat W^T by torch's dense kernel, in dense_dtype where set (the result then in it too), else flat's."""
        return torch.nn.functional.linear(flat.to(self.dense_dtype or flat.dtype), w.to(self.dense_dtype or flat.dtype))

    def extra_repr(self) -> str:
        group = f", group={self.group}" if self.kind != "int8" else ""
        return f"{self.kind}, in_features={self.in_features}, out_features={self.out_features}{group}"


INT8_KERNEL_K = 16  # torch's int8 kernel takes bf16 rows of a multiple of 16 features (others crash the process:
# torch 2.13, K = 20, 24, 40, 56 measured); a layer of another width takes the dense form
DENSE_PROMPT = 64  # positions a row from which a prompt's int8 products take the dense form (int8_dense)


def dense_prompt(positions: int) -> bool:
    """Whether a forward of `positions` tokens a row takes its int8 products by the dense kernel (int8_dense):
    rows the server prefills together are of one kind, so that each is taken as it would be alone."""
    return positions >= DENSE_PROMPT


def int8_dense(x: Tensor, dtype: torch.dtype) -> bool:
    """Whether an int8 layer takes its input x (..., T, in), in rows of `dtype`, as (x q^T) s, the codes converted
    (exact: |q| <= 127) for torch's dense kernel, the row scales after, instead of by torch's int8 kernel.

    With bf16 rows: for a forward of DENSE_PROMPT positions a row or more (a long prompt's prefill, an
    evaluation's windows), where torch's int8 kernel is the slower (`python benchmarks/int8_rows.py`, 2026-12-05,
    a 2-core AMD EPYC with avx512_bf16, SmolLM2's four shapes summed: the int8 kernel 1.2x faster at 16 rows,
    even at 32 to 64, 1.5x slower at 96, 2x at 128 to 512; one row, a decode step's: 4-7x faster). The choice
    follows the positions a row, not the call's row count, so that a prompt's products are taken alike alone and
    in a batch of prompts of its kind (`qkv serve`: a request's greedy tokens do not depend on the others); a
    flat (rows, in) input (an MoE expert's tokens) keeps the int8 kernel. With fp32 rows (what a CPU without
    native bf16 hands the layer) always: there torch's int8 kernel is 2-4x slower already at one row and about
    30x at 128 (same benchmark)."""
    if dtype != torch.bfloat16:
        return True
    return x.dim() >= 3 and dense_prompt(x.shape[-2])


class QuantProduct(torch.autograd.Function):
    """y = x W^T through the kernel, with the input's gradient dL/dx = g W (W dequantized for the backward, not
    kept): what QLoRA needs to train adapters on layers below a quantized one. W itself is frozen."""

    @staticmethod
    def forward(ctx, flat: Tensor, layer: "QuantLinear", dense: bool) -> Tensor:
        ctx.layer = layer
        return layer.product(flat, dense)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return grad @ ctx.layer.weight.to(grad.dtype), None, None


def head_kind() -> str:
    """A quantized model's head: bf16 where the CPU has it natively, else int8 (llama.cpp keeps heads above 4 bits)."""
    return "bf16" if hardware.native_bf16_cpu() else "int8"


def kind_for(quant: str, linear: nn.Linear, is_head: bool, group: int = GROUP, head: str | None = None) -> str:
    """`quant` for every linear layer but the output head (and the tied embedding it is), which gets `head`
    (head_kind() when None); int4 shapes the int4 kernel cannot take get int8."""
    if is_head:
        return head or head_kind()
    if quant == "int4" and not int4_supported(linear.weight, group):
        return "int8"
    return quant


def quantize_model(model: nn.Module, quant: str, group: int = GROUP, *, empty: bool = False,
                   head: str | None = None) -> dict[str, int]:
    """Swap every nn.Linear of `model` for a QuantLinear (`quant` int8 or int4), the output head for `head`'s
    kind (kind_for); `empty`: zero codes of the right shapes, to load saved ones into. Returns how many layers
    got each kind."""
    lm_head = getattr(model, "lm_head", None)
    counts = {"int8": 0, "int4": 0, "bf16": 0}

    def make(linear: nn.Linear) -> nn.Module:
        kind = kind_for(quant, linear, linear is lm_head, group, head)
        counts[kind] += 1
        if kind == "bf16":
            return Bf16Linear(linear.weight if not empty else torch.zeros(linear.weight.shape), linear.bias)
        if empty:
            return QuantLinear.empty(kind, linear.in_features, linear.out_features, linear.bias is not None, group)
        return QuantLinear.from_linear(linear, kind, group)

    with torch.no_grad():
        swap(model, quantizable, make)
    return counts


def quantization_of(model: nn.Module) -> str:
    """The quant a model's linear layers hold, first found of: gguf (blocks as shipped), int4, int8, none."""
    kinds = {module.kind for module in model.modules() if isinstance(module, QuantLinear)}
    return "gguf" if "int8g" in kinds else "int4" if "int4" in kinds else "int8" if kinds else "none"


def head_of(model: nn.Module) -> str:
    """The kind of a quantized model's output head: bf16, int8 or int4 (none: not quantized)."""
    head = getattr(model, "lm_head", None)
    return "bf16" if isinstance(head, Bf16Linear) else head.kind if isinstance(head, QuantLinear) else "none"
