"""int4's products of a few rows by qkv/nn/grouped.c's loops (qkv.nn.grouped.native_int4_product): against the
float64 product of the same codes, with the loops built for this machine and with the plain loops a machine
without AVX2 builds; in a layer of --quant int4 and of GGUF's 4-bit blocks, each row alike alone or batched;
and as one operator of a compiled graph."""
import ctypes
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from qkv.formats.gguf import blocks
from qkv.nn import grouped, native
from qkv.nn.quant import DENSE_PROMPT, QuantLinear, pack_nibbles
from tests.formats.gguf.test_blocks import blocks_of
from tests.nn.test_native import compiled_row_is_the_eager_one, short_rows_take_the_loops

pytestmark = pytest.mark.skipif(native.compiler() is None, reason="no C compiler on PATH to build grouped.c with")


def random_int4(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """codes (N, K) in 0..15, scales and minima (N, K / 32)."""
    generator = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=generator)
    return codes, torch.rand(n, k // 32, generator=generator) / 64, torch.randn(n, k // 32, generator=generator) / 8


def float64_product(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, low: torch.Tensor) -> torch.Tensor:
    n, k = codes.shape
    w = codes.double().view(n, k // 32, 32) * scale.double()[..., None] + low.double()[..., None]
    return x.double() @ w.view(n, k).t()


@pytest.mark.parametrize("k", [32, 96, 576])  # (1 and 3 groups: the odd group's accumulator; 18 groups)
@pytest.mark.parametrize("rows", [1, 3, 6])  # (passes of four rows: 6 = four and two)
def test_the_loops_give_the_float64_product_and_a_row_alone_its_batched_result(k, rows):
    codes, scale, low = random_int4(37, k, seed=k + rows)  # (37 output rows: an odd count shared by the threads)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    got = grouped.native_int4_product(x, pack_nibbles(codes), scale, low)
    want = float64_product(x, codes, scale, low)
    assert got.dtype == torch.float32 and got.shape == (rows, 37)
    assert (got.double() - want).abs().max() <= 1e-6 * want.abs().max()  # fp32 sums: ~1e-7 measured
    assert all(torch.equal(got[m:m + 1], grouped.native_int4_product(x[m:m + 1], pack_nibbles(codes), scale, low))
               for m in range(rows))


def test_the_plain_loops_of_a_machine_without_avx2_give_the_same_product(tmp_path):
    """grouped.c built without -march=native (no AVX2: its plain loops), called as qkv calls the kept one."""
    out = tmp_path / "plain.so"
    source = str(Path(native.__file__).with_name("grouped.c"))
    done = subprocess.run([native.compiler(), "-O3", "-shared", "-fPIC", source,
                           "-o", str(out)], capture_output=True)
    assert done.returncode == 0, done.stderr.decode()
    function = ctypes.CDLL(str(out)).qkv_int4_rows
    function.argtypes = grouped.INT4_ARGTYPES
    codes, scale, low = random_int4(21, 96, seed=5)
    x = torch.randn(5, 96)
    packed, y = pack_nibbles(codes), torch.empty(5, 21)
    function(x.data_ptr(), 5, 96, packed.data_ptr(), 21, scale.data_ptr(), low.data_ptr(), y.data_ptr(), 1)
    want = float64_product(x, codes, scale, low)
    assert (y.double() - want).abs().max() <= 1e-6 * want.abs().max()


def gguf_int4_layer(type_name: str, n: int = 48, k: int = 256) -> tuple[QuantLinear, torch.Tensor]:
    """A layer holding a GGUF 4-bit type's codes (the gguf package's quantizer, or random K-quant blocks) and
    its dequantized W."""
    w = np.random.default_rng(7).standard_normal((n, k)).astype(np.float32)
    codes, scale, low = blocks.decode(blocks_of(w, type_name), type_name)  # (Q4_0's minimum: -8 s)
    layer = QuantLinear.from_codes(torch.from_numpy(codes).to(torch.uint8), torch.from_numpy(scale),
                                   torch.from_numpy(low), torch.randn(n), kind="int4")
    return layer, torch.from_numpy(blocks.dequantize(codes, scale, low))


@pytest.mark.parametrize("source", ["Q4_0", "Q4_1", "Q4_K", "--quant int4"])
def test_a_layers_short_forwards_take_the_loops_each_row_as_alone(source, monkeypatch):
    """A decode step's row and a prompt's rows under DENSE_PROMPT positions, in fp32 through the loops: the
    dequantized product to fp32's rounding and each row bit for bit its product alone; a longer prompt takes
    torch's int4 kernel."""
    if source == "--quant int4":
        layer = QuantLinear.from_linear(torch.nn.Linear(256, 48), "int4")
        w = layer.weight
    else:
        layer, w = gguf_int4_layer(source)
    assert layer.kind == "int4"
    calls = short_rows_take_the_loops(layer, w, "native_int4_product", monkeypatch)
    with torch.no_grad():
        long = torch.randn(1, DENSE_PROMPT, 256)
        got = layer(long)
    assert len(calls) == 12  # (torch's kernel, bf16 rows: its rounding)
    want = long.double() @ w.double().t() + layer.bias.double()
    assert (got.double() - want).abs().max() <= 2e-2 * want.abs().max()


@pytest.mark.skipif(shutil.which("c++") is None and shutil.which("g++") is None,
                    reason="torch.compile on the CPU needs a C++ compiler; none on PATH")
def test_a_compiled_row_calls_the_int4_loops_as_one_operator(monkeypatch, tmp_path):
    """Inside a compiled graph the loops are one operator (qkv::native_int4): the eager product exactly."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    compiled_row_is_the_eager_one(*gguf_int4_layer("Q4_K"))
