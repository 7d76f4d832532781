"""GGUF's quantized blocks read as they are: the codes, scales and minima of each block, exactly, in qkv's
quantized layouts (qkv.nn.quant), so that a file's weights run as shipped, never dequantized to float and
quantized again.

Each block type stores W_ij = s q_ij + m over a group of consecutive inputs j of row i (ggml's block
formats, ggml-quants.c; the gguf package's `quants.dequantize` is the tests' oracle):

    type   group  bytes a block            q             s                       m
    Q4_0   32     d, 16 nibble bytes       0..15         d                       -8 d
    Q4_1   32     d, m, 16 nibble bytes    0..15         d                       m
    Q5_0   32     d, 32 high bits, 16 B    0..31         d                       -16 d
    Q5_1   32     d, m, 32 high bits, 16 B 0..31         d                       m
    Q8_0   32     d, 32 int8               -127..127     d                       0
    Q4_K   32     (super-block of 256: d, dmin, 12 B of 6-bit scales sc and mins mn, 128 nibble bytes)
                                           0..15         d sc                    -dmin mn
    Q5_K   32     (the same and 32 B of high bits)
                                           0..31         d sc                    -dmin mn
    Q6_K   16     (super-block of 256: 128 B low nibbles, 64 B of 2-bit highs, 16 int8 scales sc, d)
                                           0..63 - 32    d sc                    0

d, m, dmin fp16; s and m are formed in fp32, where d sc (an fp16 times a 6- or 8-bit integer) is exact.
The 4-bit types become qkv's int4 layer (codes 0..15 by groups of 32, a scale and a minimum each: GGUF's own
Q4_1 layout); the others its grouped 8-bit one, "int8g" (codes q - c in int8 with c = 16 or 32 folded into
m, by groups of 32 or 16). Every function returns (codes (rows, K) uint8 or int8, scale (rows, K / G) fp32,
low (rows, K / G) fp32 or None), from the tensor's raw bytes (rows, blocks a row x block bytes).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from qkv.nn.grouped import native_rows
from qkv.nn.quant import QuantLinear, quantizable

INT4_TYPES = ("Q4_0", "Q4_1", "Q4_K")
INT8G_TYPES = ("Q8_0", "Q5_0", "Q5_1", "Q5_K", "Q6_K")
SHIPPED_TYPES = INT4_TYPES + INT8G_TYPES
BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q5_0": 22, "Q5_1": 24, "Q8_0": 34, "Q4_K": 144, "Q5_K": 176, "Q6_K": 210}
BLOCK_VALUES = {"Q4_K": 256, "Q5_K": 256, "Q6_K": 256}  # the others: 32


def kind_of(type_name: str) -> str:
    """qkv's layer kind for a block type: int4 or int8g."""
    return "int4" if type_name in INT4_TYPES else "int8g"


def decode(raw: np.ndarray, type_name: str) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """(rows, bytes) uint8 of blocks of `type_name` -> (codes, scale, low) as the module docstring says."""
    codes, scale, low = decode_groups(raw, type_name)
    return codes.reshape(len(codes), -1), scale, low


def decode_groups(raw: np.ndarray, type_name: str) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """decode with the codes by groups (rows, K / G, G): Q8_0's a view of `raw` (a memory-mapped file's
    bytes), nothing copied."""
    rows = raw.shape[0]
    blocks = np.ascontiguousarray(raw).reshape(rows, -1, BLOCK_BYTES[type_name])  # (rows, blocks, bytes)
    codes, scale, low = DECODERS[type_name](blocks)
    scale = scale.reshape(rows, -1).astype(np.float32)
    return (codes.reshape(rows, scale.shape[1], -1), scale,
            None if low is None else low.reshape(rows, -1).astype(np.float32))


def _half(blocks: np.ndarray, start: int) -> np.ndarray:
    """The fp16 at byte `start` of every block, as fp32."""
    return blocks[..., start:start + 2].copy().view(np.float16)[..., 0].astype(np.float32)


def _nibbles(packed: np.ndarray) -> np.ndarray:
    """16 bytes (..., 16) -> 32 codes: the low four bits are values 0..15, the high four values 16..31."""
    return np.concatenate((packed & 15, packed >> 4), axis=-1)


def _high_bits(blocks: np.ndarray, start: int) -> np.ndarray:
    """The 32 fifth bits of a Q5_0 / Q5_1 block (a little-endian uint32 at `start`), as 0 or 16 per value."""
    bits = np.unpackbits(blocks[..., start:start + 4], axis=-1, bitorder="little")  # bit j: value j
    return bits.astype(np.uint8) << 4


def _q4_0(blocks):
    d = _half(blocks, 0)
    return _nibbles(blocks[..., 2:18]), d, -8.0 * d


def _q4_1(blocks):
    return _nibbles(blocks[..., 4:20]), _half(blocks, 0), _half(blocks, 2)


def _q5_0(blocks):
    q = _nibbles(blocks[..., 6:22]) | _high_bits(blocks, 2)
    return (q.astype(np.int16) - 16).astype(np.int8), _half(blocks, 0), None


def _q5_1(blocks):
    d, m = _half(blocks, 0), _half(blocks, 2)
    q = _nibbles(blocks[..., 8:24]) | _high_bits(blocks, 4)
    return (q.astype(np.int16) - 16).astype(np.int8), d, m + 16.0 * d


def _q8_0(blocks):
    return blocks[..., 2:34].view(np.int8), _half(blocks, 0), None


def _k_scales(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K's and Q5_K's 12 bytes -> the 6-bit scales and mins of the 8 sub-blocks (ggml's get_scale_min_k4)."""
    q = packed.astype(np.uint8)
    low_sc, low_mn = q[..., 0:4] & 63, q[..., 4:8] & 63  # sub-blocks 0..3
    high_sc = (q[..., 8:12] & 15) | ((q[..., 0:4] >> 6) << 4)  # sub-blocks 4..7
    high_mn = (q[..., 8:12] >> 4) | ((q[..., 4:8] >> 6) << 4)
    return np.concatenate((low_sc, high_sc), -1), np.concatenate((low_mn, high_mn), -1)


def _k_groups(blocks, data: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The 4-bit codes (..., 256) of a Q4_K / Q5_K super-block (bytes `data`..+128: four chunks of 32 bytes,
    each the low nibbles of 32 values and then the high nibbles of the next 32), its scales and minima (..., 8)."""
    d, dmin = _half(blocks, 0), _half(blocks, 2)
    sc, mn = _k_scales(blocks[..., 4:16])
    chunks = blocks[..., data:data + 128].reshape(*blocks.shape[:-1], 4, 32)
    low = np.stack((chunks & 15, chunks >> 4), axis=-2).reshape(*blocks.shape[:-1], 256)
    return low, d[..., None] * sc, -(dmin[..., None] * mn)


def _q4_k(blocks):
    return _k_groups(blocks, 16)


def _q5_k(blocks):
    low, scale, minimum = _k_groups(blocks, 48)
    # bit 2c of the 32 high-bit bytes is the fifth bit of chunk c's low-nibble values, bit 2c + 1 of its high ones
    bits = np.unpackbits(blocks[..., 16:48, None], axis=-1, bitorder="little")  # (..., 32 bytes, 8 bits)
    high = np.moveaxis(bits, -1, -2).reshape(*blocks.shape[:-1], 256)  # value 32 k + l: bit k of byte l
    q = (low | (high << 4)).astype(np.int16) - 16
    return q.astype(np.int8), scale, minimum + 16.0 * scale


def _q6_k(blocks):
    ql, qh = blocks[..., 0:128], blocks[..., 128:192]
    sc = blocks[..., 192:208].copy().view(np.int8).astype(np.float32)
    d = _half(blocks, 208)
    halves = []
    for h in range(2):  # each half of 128 values: 64 low-nibble bytes, 32 high-bit bytes
        lo, hi = ql[..., 64 * h:64 * h + 64], qh[..., 32 * h:32 * h + 32]
        parts = [(lo[..., :32] & 15) | ((hi & 3) << 4), (lo[..., 32:] & 15) | (((hi >> 2) & 3) << 4),
                 (lo[..., :32] >> 4) | (((hi >> 4) & 3) << 4), (lo[..., 32:] >> 4) | (((hi >> 6) & 3) << 4)]
        halves.extend(parts)
    q = np.concatenate(halves, axis=-1).astype(np.int16) - 32  # (..., 256)
    return q.astype(np.int8), d[..., None] * sc, None


DECODERS = {"Q4_0": _q4_0, "Q4_1": _q4_1, "Q5_0": _q5_0, "Q5_1": _q5_1, "Q8_0": _q8_0,
            "Q4_K": _q4_k, "Q5_K": _q5_k, "Q6_K": _q6_k}


def dequantize(codes: np.ndarray, scale: np.ndarray, low: np.ndarray | None) -> np.ndarray:
    """W = s q + m by groups: the float values the codes stand for (for the tests and analyses)."""
    rows, k = codes.shape
    groups = scale.shape[1]
    w = codes.astype(np.float32).reshape(rows, groups, k // groups) * scale[..., None]
    if low is not None:
        w = w + low[..., None]
    return w.reshape(rows, k)


@dataclass
class Shipped:
    """A weight read as its file's blocks: codes (int4: rows, K / G, G; int8g: K / G, rows, G as the layer holds
    them), scales and minima (rows, K / G) (decode_groups) and its type's name; nothing a view of the file."""
    codes: np.ndarray
    scale: np.ndarray
    low: np.ndarray | None
    type_name: str

    def layer(self, bias: torch.Tensor | None) -> QuantLinear:
        """The QuantLinear holding these blocks (bias: the layer's, float)."""
        if kind_of(self.type_name) == "int8g":  # (rows, K / G, G) as a view: QuantLinear keeps the layout as it is
            codes = torch.from_numpy(self.codes).transpose(0, 1)
        else:
            codes = torch.from_numpy(self.codes.reshape(len(self.codes), -1))
        layer = QuantLinear.from_codes(codes, torch.from_numpy(self.scale),
                                       None if self.low is None else torch.from_numpy(self.low), bias,
                                       kind=kind_of(self.type_name))
        layer.origin = self.type_name  # (what the description of the model names: qkv.generate.weights)
        return layer


def shippable(tensor, module: nn.Module | None, name: str) -> bool:
    """Whether a file tensor becomes a layer holding its blocks: a 2-D tensor of a block type kept as
    shipped, read into the weight of a plain linear layer that --quant would quantize (qkv.nn.quant.quantizable)."""
    return (tensor.tensor_type.name in SHIPPED_TYPES and len(tensor.shape) == 2 and module is not None
            and quantizable(name, module))


def read_shipped(file, arch, hf: dict, name: str, hf_name: str) -> Shipped | None:
    """The tensor `name` as its blocks, rows in the order the HF checkpoint holds them (arch.to_hf's order,
    found by passing it the row numbers); None where to_hf does more than reorder rows (the caller then
    reads the tensor dequantized)."""
    tensor = file.tensors[name]
    raw = np.asarray(tensor.data)
    raw = raw.reshape(-1, raw.shape[-1])
    order = row_order(arch, hf_name, raw.shape[0], hf)
    if order is None:
        return None
    codes, scale, low = decode_groups(raw, tensor.tensor_type.name)
    moved = not np.array_equal(order, np.arange(len(order)))
    if moved:
        scale, low = scale[order], None if low is None else low[order]
    if kind_of(tensor.tensor_type.name) == "int8g":  # one copy of the file's bytes (Q8_0's) in the layer's layout:
        if native_rows():  # rows after rows, seen as (G, N, g) (qkv.nn.grouped.grouped_layout)
            codes = np.ascontiguousarray(codes[order] if moved else codes).transpose(1, 0, 2)
        else:  # each group's plane
            codes = np.ascontiguousarray(codes.transpose(1, 0, 2)[:, order] if moved else codes.transpose(1, 0, 2))
    elif moved:
        codes = codes[order]
    file.release()  # (the file's pages read: copies made of them)
    return Shipped(codes, scale, low, tensor.tensor_type.name)


def row_order(arch, hf_name: str, rows: int, hf: dict) -> np.ndarray | None:
    """Where arch.to_hf takes each row from, or None when it is not a reordering of whole rows."""
    probe = np.arange(rows, dtype=np.float64)[:, None].repeat(2, axis=1)
    try:
        out = np.asarray(arch.to_hf(hf_name, probe.copy(), hf))
    except Exception:  # noqa: BLE001  (a mapping that needs the real shape: read it dequantized)
        return None
    if out.shape != probe.shape or not np.array_equal(np.sort(out[:, 0]), probe[:, 0]) \
            or not np.array_equal(out[:, 0], out[:, 1]):
        return None
    return out[:, 0].astype(np.int64)
