"""int8g's products of a few rows by qkv/nn/grouped.c's loops (qkv.nn.grouped.native_product), built by the
machine's C compiler (qkv.nn.native): against the float64 product of the same codes, eagerly, in a layer, and as
one operator of a compiled graph; and the build's failures, which leave torch's kernels in charge."""
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from qkv import hardware
from qkv.formats.gguf import blocks
from qkv.nn import grouped, native
from qkv.nn.quant import DENSE_PROMPT, QuantLinear
from tests.formats.gguf.test_blocks import blocks_of

pytestmark = pytest.mark.skipif(native.compiler() is None, reason="no C compiler on PATH to build grouped.c with")
CPUINFO = Path("/proc/cpuinfo")
AVX2 = "avx2" in hardware.cpu_flags(CPUINFO.read_text() if CPUINFO.is_file() else "")  # (grouped.c's 8-lane loops)


def float64_product(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, low: torch.Tensor | None):
    """x (M, K) W^T with W = s q + m by groups: codes (G, N, g), scale and low (N, G), all in float64."""
    w = codes.double().permute(1, 0, 2) * scale.double()[..., None]
    if low is not None:
        w = w + low.double()[..., None]
    return x.double() @ w.reshape(codes.shape[1], -1).t()


@pytest.mark.parametrize("g", [32, 16, 12])  # (12: the plain loops; 16 and 32: eight lanes where built with AVX2)
@pytest.mark.parametrize("rows", [1, 2, 4, 6])  # (passes of three rows: 4 = three and one alone, 6 = two)
@pytest.mark.parametrize("minima", [False, True])
def test_the_loops_give_the_float64_product_to_fp32s_rounding(g, rows, minima):
    generator = torch.Generator().manual_seed(g + rows)
    groups, n = 192 // g, 37  # (37 output rows: an odd count shared among the threads)
    codes = torch.randint(-128, 128, (groups, n, g), dtype=torch.int8, generator=generator)
    scale = torch.rand(n, groups, generator=generator) / 64
    low = -torch.rand(n, groups, generator=generator) if minima else None
    x = torch.randn(rows, groups * g, generator=generator)
    got = grouped.native_product(x, codes, scale.t().contiguous(), low)
    want = float64_product(x, codes, scale, low)
    assert got.dtype == torch.float32 and got.shape == (rows, n)
    assert (got.double() - want).abs().max() <= 1e-6 * want.abs().max()  # fp32 sums of 192 terms: ~1e-7 here


@pytest.mark.parametrize("g", [32, 16, 12])  # (12: no narrow loops, the widened ones exactly)
@pytest.mark.parametrize("rows", [1, 2, 4, 6])
@pytest.mark.parametrize("minima", [False, True])
def test_narrow_rows_stay_within_their_rounding_bound_alike_alone_or_batched(g, rows, minima):
    """The rows rounded to int16 by groups (grouped.c's header): |y - y64| <= sum_g |s_g| t_g / 2 sum_j |q_j|
    with t_g = max_j |x_j| / 32,767, plus fp32's rounding; each row bit for bit its product alone."""
    generator = torch.Generator().manual_seed(7 * g + rows)
    groups, n = 192 // g, 37
    codes = torch.randint(-128, 128, (groups, n, g), dtype=torch.int8, generator=generator)
    scale = torch.rand(n, groups, generator=generator) / 64
    low = -torch.rand(n, groups, generator=generator) if minima else None
    x = torch.randn(rows, groups * g, generator=generator) * torch.logspace(-3, 1, groups * g)  # groups unalike
    got = grouped.native_product(x, codes, scale.t().contiguous(), low, True)
    want = float64_product(x, codes, scale, low)
    step = x.double().view(rows, groups, g).abs().amax(-1) / 32767  # (M, G)
    bound = (step[:, None, :] / 2 * scale.double()[None] * codes.double().abs().sum(-1).t()[None]).sum(-1)  # (M, N)
    assert ((got.double() - want).abs() <= bound + 1e-6 * want.abs().max()).all()
    if g % 16 == 0:  # (narrow where built with AVX2: not the widened loops' 1e-7)
        assert not AVX2 or (got.double() - want).abs().max() > 1e-6 * want.abs().max()
    alone = torch.cat([grouped.native_product(x[m:m + 1], codes, scale.t().contiguous(), low, True) for m in range(rows)])
    assert torch.equal(alone, got)


def test_narrow_rows_with_a_value_not_finite_give_nan_and_tiny_groups_zeros():
    """(Where built with AVX2: elsewhere the widened loops, whose infinities stay what fp32 makes of them.)"""
    generator = torch.Generator().manual_seed(2)
    codes = torch.randint(-128, 128, (4, 5, 32), dtype=torch.int8, generator=generator)
    scale = torch.rand(4, 5, generator=generator)
    x = torch.randn(3, 128, generator=generator)
    x[0, 40], x[1, 3], x[2, :32] = float("inf"), float("nan"), 1e-31
    got = grouped.native_product(x, codes, scale, None, True)
    wide = grouped.native_product(x, codes, scale, None, False)
    assert not wide[:2].isfinite().any() and (got[:2].isnan().all() if AVX2 else not got[:2].isfinite().any())
    want = float64_product(x[2:, 32:], codes[1:], scale.t()[:, 1:], None)  # its first group counts as zeros
    assert (got[2:].double() - want).abs().max() <= 1e-4 * want.abs().max()


def test_codes_and_minima_viewed_from_another_layout_are_read_through_their_strides():
    """The codes as a file lays them out, (N, G, g), seen as (G, N, g) without a copy; the minima transposed."""
    generator = torch.Generator().manual_seed(1)
    codes = torch.randint(-128, 128, (40, 8, 32), dtype=torch.int8, generator=generator).permute(1, 0, 2)
    scale, low = torch.rand(40, 8, generator=generator), torch.rand(8, 40, generator=generator).t()
    x = torch.randn(2, 256, generator=generator)
    got = grouped.native_product(x, codes, scale.t().contiguous(), low)
    want = float64_product(x, codes, scale, low)
    assert (got.double() - want).abs().max() <= 1e-6 * want.abs().max()


def shipped_layer(type_name: str, n: int = 48, k: int = 256) -> tuple[QuantLinear, torch.Tensor]:
    """A layer holding a GGUF block type's codes (through the gguf package's quantizer) and its dequantized W."""
    w = np.random.default_rng(4).standard_normal((n, k)).astype(np.float32)
    codes, scale, low = blocks.decode(blocks_of(w, type_name), type_name)
    layer = QuantLinear.from_codes(torch.from_numpy(codes), torch.from_numpy(scale),
                                   None if low is None else torch.from_numpy(low), torch.randn(n))
    return layer, torch.from_numpy(blocks.dequantize(codes, scale, low))


@pytest.mark.parametrize("type_name", ["Q8_0", "Q5_0", "Q5_K", "Q6_K"])
@pytest.mark.parametrize("narrow", [False, True])
def test_a_layers_rows_take_the_loops_unrounded_and_alike_alone_or_batched(type_name, narrow, monkeypatch):
    """A decode step's row and a prompt's rows under DENSE_PROMPT positions, fp32, through the loops (the rows
    not rounded to the bf16 torch's int8 kernel takes): the dequantized product to fp32's rounding (a prompt's
    rows narrow: within 1e-4 of the largest output), and each row's product bit for bit the one it has alone
    (a server's batch); a longer prompt another form."""
    layer, w = shipped_layer(type_name)  # (first: a first layer may measure the loops, qkv.nn.forms)
    layer.narrow = narrow
    calls = short_rows_take_the_loops(layer, w, "native_product", monkeypatch)
    with torch.no_grad():
        layer(torch.randn(1, DENSE_PROMPT, 256))
    assert len(calls) == 12


@pytest.mark.skipif(shutil.which("c++") is None and shutil.which("g++") is None,
                    reason="torch.compile on the CPU needs a C++ compiler; none on PATH")
def test_a_compiled_row_calls_the_loops_as_one_operator(monkeypatch, tmp_path):
    """Inside a compiled graph (the decoding step's cpp_wrapper form) the loops are one operator
    (qkv::native_grouped): the eager layer's product exactly (a decoding step's row in fp32, narrow or not), and
    a prompt's rows rounded to int16 the eager ones exactly."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    layer, w = shipped_layer("Q6_K")
    layer.narrow = True
    compiled_row_is_the_eager_one(layer, w)
    x = torch.randn(1, 5, 256)
    prompt = torch.compile(layer, dynamic=False, options={"cpp_wrapper": True})
    with torch.no_grad():
        got, eager, wide = prompt(x), layer(x), grouped.native_product(x[0], layer.codes, layer.scale.t(), layer.low)
    torch._dynamo.reset()
    assert torch.equal(got, eager) and not torch.equal(eager[0] - layer.bias, wide)  # (narrow: not the fp32 rows')


def short_rows_take_the_loops(layer: QuantLinear, w: torch.Tensor, product: str, monkeypatch) -> list:
    """`layer` (its dequantized weight w) on a decode step's row, a prompt's rows under DENSE_PROMPT positions
    and a batch's, in fp32 through grouped's `product`: w's float64 product to fp32's rounding, each row bit for
    bit its product alone. The calls of `product` (2 + 2 + 8: each shape whole, then row by row), for more."""
    calls = []
    loops = getattr(grouped, product)
    monkeypatch.setattr(grouped, product, lambda *args: calls.append(1) or loops(*args))
    layer.native, layer.compute_dtype = True, torch.bfloat16
    for shape in ((1, 1, 256), (1, DENSE_PROMPT - 1, 256), (7, 5, 256)):
        x = torch.randn(shape)
        with torch.no_grad():
            got = layer(x)
            assert all(torch.equal(got[b:b + 1], layer(x[b:b + 1])) for b in range(shape[0]))
        want = x.double() @ w.double().t() + layer.bias.double()
        narrow = getattr(layer, "narrow", False) and shape[1] > 1  # (a prompt's rows: a decoding step's stay fp32)
        assert (got.double() - want).abs().max() <= (1e-4 if narrow else 1e-5) * want.abs().max()
    assert len(calls) == 2 + 2 + 8
    return calls


def compiled_row_is_the_eager_one(layer: QuantLinear, w: torch.Tensor) -> None:
    """One row of `layer` through the loops inside a compiled graph (cpp_wrapper, as the decoding step): the
    eager product exactly, and w's float64 product to fp32's rounding."""
    layer.native = True
    x = torch.randn(1, 1, 256)
    step = torch.compile(layer, dynamic=False, options={"cpp_wrapper": True})
    with torch.no_grad():
        got, eager = step(x), layer(x)
    torch._dynamo.reset()
    assert torch.equal(got, eager)
    want = x.double() @ w.double().t() + layer.bias.double()
    assert (got.double() - want).abs().max() <= 1e-5 * want.abs().max()


def test_no_library_where_the_build_fails_or_is_turned_off(monkeypatch, tmp_path):
    """A compiler that fails leaves nothing in the cache and no library (torch's kernels then); QKV_NATIVE=0
    builds nothing; a build that works is kept and loaded again from the cache."""
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("CC", shutil.which("false"))
    assert native.build("grouped") is None
    assert not any((tmp_path / ".cache" / "qkv" / "native").glob("*"))
    monkeypatch.delenv("CC")
    monkeypatch.setattr(native, "_built", {})
    monkeypatch.setenv("QKV_NATIVE", "0")
    assert native.library("grouped") is None and not any((tmp_path / ".cache" / "qkv" / "native").glob("*"))
    monkeypatch.delenv("QKV_NATIVE")
    monkeypatch.setattr(native, "_built", {})
    assert native.library("grouped") is not None
    kept = list((tmp_path / ".cache" / "qkv" / "native").glob("grouped-*.so"))
    assert len(kept) == 1
    monkeypatch.setattr(native.subprocess, "run", lambda *args, **kwargs: pytest.fail("built again"))
    assert native.build("grouped") is not None
