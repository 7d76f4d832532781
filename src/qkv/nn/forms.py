"""Which form of a decoding step's one-row products is the faster on this machine: measured once, kept.

A decoding step multiplies every weight matrix by one row, so its time is the time to read the weights, and
how fast torch's kernels read them depends on the CPU, not on its vendor alone (MKL picks its fp32 kernels by
vendor; oneDNN's bf16 ones by AMX or avx512_bf16; docs/real-models.md has the figures of both machine kinds).
Each is measured on matrices too big for the caches, as a step reads them, both sides alternating:

    left_fp32, left_bf16          W x^T (qkv.nn.decoding_linear.left_product) against nn.Linear's x W^T, eagerly
    summed_fp32, summed_bf16,     one row as the sums inductor writes (summed_product, inside the compiled step)
    summed_int8                   against torch's kernel in its faster form (int8: _weight_int8pack_mm)
    quant_rows_bf16               the int8 and int4 weight-only kernels with bf16 rows against fp32 rows
                                  (qkv.nn.quant.QuantLinear.compute_dtype)
    native_int8g                  a GGUF file's 5- to 8-bit blocks (int8g) times one fp32 row by the loops of
                                  qkv/nn/grouped.c against torch's int8 kernel group by group with a bf16 row
    narrow_int8g                  those loops with a prompt's rows rounded to int16 by groups, the products
                                  summed as integers, against the rows in fp32 (qkv.nn.grouped.narrow_rows)
    dense_bf16                    a prompt's dense products (a quantized layer's codes or W converted for
                                  torch's dense kernel) in bf16 against fp32 (QuantLinear.dense_dtype)

An AVX2-only EPYC (2026-12-07, 2 threads, 48 MB of SmolLM2-shaped matrices a pass) showed why by dtype: the sums
read fp32 in 2.1 ms against torch's 4.7 and bf16 in 4.3 against 5.6, but int8 codes in 39 ms against the int8
kernel's 6.8 (inductor converts int8 there without AVX-512).

The first process that asks measures (on the AVX2 EPYC: the left forms 0.3 s and the rows' precision 1.0 s, on
the thread that loads the model; the summed forms 6 s, each compiling a small graph, on the compiled step's
background thread) and writes the result to ~/.cache/qkv/product-forms.json under this machine's key (its CPU
model and native bf16, torch's version and thread count): a later start reads it. Delete the file to measure
again. A file that cannot be read is measured over and rewritten. The random weights a measurement draws leave
torch's random state as it was.
"""
from __future__ import annotations

import datetime
import json
import os
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from qkv import hardware

FILE_NAME = "product-forms.json"
MEGABYTES = 48  # of weights of each dtype a measurement reads per pass: beyond the last-level caches here
ROUNDS = 7  # alternating passes of each form; the fastest of each are compared
# one lock a choice: an eager step may ask for a left form while another thread measures the summed one
_locks = {name: threading.RLock() for name in ("left_fp32", "left_bf16", "summed_fp32", "summed_bf16", "summed_int8",
                                                "quant_rows_bf16", "dense_bf16", "native_int8g",
                                                "native_int4", "narrow_int8g")}
_measuring = threading.local()  # the choices this thread is measuring (a layer its measurement builds asks too)
_write_lock = threading.Lock()
_known: dict[str, bool] = {}


def forms_file() -> Path:
    return Path.home() / ".cache" / "qkv" / FILE_NAME


def machine_key() -> str:
    """What the choice depends on: the CPU model and its native bf16 (a VM may name only the vendor), torch's
    version and the threads torch uses."""
    return (f"{hardware.cpu_model() or 'unknown CPU'} ({hardware.native_bf16_cpu() or 'no native bf16'}) | "
            f"torch {torch.__version__} | {torch.get_num_threads()} threads")


def choice(name: str, measure: Callable[[], dict] | None = None) -> bool | None:
    """The kept choice `name` (left_fp32, left_bf16, summed_fp32, summed_bf16, summed_int8, quant_rows_bf16,
    dense_bf16) for
    this machine; measured with `measure` (returning {"choice": bool, ...figures}) and kept where there is none
    yet; None without `measure`, and inside its own measurement."""
    with _locks[name]:
        key = f"{machine_key()} | {name}"
        if key in _known:
            return _known[key]
        entries = read_entries()
        entry = entries.get(key)
        if not (isinstance(entry, dict) and isinstance(entry.get("choice"), bool)):
            measuring = getattr(_measuring, "names", set())
            if measure is None or name in measuring:
                return None
            _measuring.names, profile = measuring | {name}, sys.getprofile()
            sys.setprofile(None)  # (the compiling thread's yield to decoding would sleep inside a timed pass)
            try:
                with torch.random.fork_rng(devices=[]):  # its random weights leave the caller's random state as it was
                    entry = {**measure(), "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
            finally:
                _measuring.names = measuring
                sys.setprofile(profile)
            with _write_lock:
                write_entries({**read_entries(), key: entry})
        _known[key] = entry["choice"]
        return entry["choice"]


def read_entries() -> dict:
    """The file's entries, or none where it is missing or not what this module writes."""
    try:
        raw = json.loads(forms_file().read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return raw if isinstance(raw, dict) else {}


def write_entries(entries: dict) -> None:
    """Replace the file at once (another process may be reading it); a cache that cannot be written is left."""
    path = forms_file()
    tmp = path.with_name(f"{FILE_NAME}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(entries, indent=1, sort_keys=True), encoding="utf-8")
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)


def weights(dtype: torch.dtype, megabytes: float = MEGABYTES) -> list[torch.Tensor]:
    """Decode-sized matrices of `megabytes` in all, in `dtype` (int8: codes), as two stacks: (L, 1536, 576) and
    (L, 576, 1536), SmolLM2's gate/up and down shapes."""
    size = torch.empty((), dtype=dtype).element_size()
    count = max(1, round(megabytes * 2 ** 20 / (2 * 1536 * 576 * size)))
    generator = torch.Generator().manual_seed(0)
    shapes = [(count, 1536, 576), (count, 576, 1536)]
    if dtype == torch.int8:
        return [torch.randint(-127, 128, shape, dtype=torch.int8, generator=generator) for shape in shapes]
    return [torch.randn(shape, generator=generator).to(dtype) for shape in shapes]


def timed(forms: dict[str, Callable[[], object]], rounds: int = ROUNDS) -> dict[str, float]:
    """The fastest of each form's passes in milliseconds, the forms alternating round by round (after one warm
    pass): other work on the machine (an eager step decoding beside the compiler's thread, which measures the
    summed forms) only adds time to a pass."""
    times: dict[str, list[float]] = {name: [] for name in forms}
    for round_ in range(rounds + 1):
        for name, run in forms.items():
            start = time.perf_counter()
            run()
            if round_:
                times[name].append((time.perf_counter() - start) * 1e3)
    return {name: min(values) for name, values in times.items()}


def same(y: torch.Tensor, reference: torch.Tensor) -> None:
    """RuntimeError unless the two forms' products agree (to bf16's rounding of either): what is timed must be
    the same product."""
    if not torch.allclose(y.float(), reference.float(), rtol=2 ** -6, atol=1e-2 * float(reference.float().abs().max())):
        raise RuntimeError("the forms measured give different products")


def measure_left(dtype: torch.dtype, left_product: Callable, megabytes: float = MEGABYTES) -> dict:
    """W x^T (`left_product`, qkv.nn.decoding_linear's) against x W^T for one row of `dtype` over
    weights(dtype): {"choice": W x^T is the faster, ms}."""
    ws = [w for stack in weights(dtype, megabytes) for w in stack]
    xs = {k: torch.randn(1, k).to(dtype) for k in (576, 1536)}
    with torch.no_grad():
        same(left_product(xs[ws[0].shape[1]], ws[0], None), F.linear(xs[ws[0].shape[1]], ws[0]))
        ms = timed({"left_ms": lambda: [left_product(xs[w.shape[1]], w, None) for w in ws],
                    "linear_ms": lambda: [F.linear(xs[w.shape[1]], w) for w in ws]})
    return {"choice": ms["left_ms"] < ms["linear_ms"], **ms}


def measure_summed(dtype: torch.dtype, left: bool, left_product: Callable, stored: Callable,
                   megabytes: float = MEGABYTES, int8_rows: torch.dtype = torch.bfloat16) -> dict:
    """One row through weights(dtype) (int8: codes with per-row scales, `int8_rows` rows) as compiled sums against
    torch's kernel in its faster form (`left`: W x^T; int8: _weight_int8pack_mm), a matrix at a time as a step
    calls them: {"choice": the sums are the faster, ms}. The sums are summed_product's, over a stack of matrices
    at once (one kernel a stack: a few seconds to compile); `stored` as qkv.nn.decoding_linear's, its prims
    registered."""
    stacks = weights(dtype, megabytes)
    scales = [torch.rand(stack.shape[:2]).to(int8_rows) for stack in stacks]
    rows = [torch.randn(stack.shape[0], 1, stack.shape[2]).to(int8_rows if dtype == torch.int8 else dtype)
            for stack in stacks]

    def kernels():
        return [torch.cat([torch._weight_int8pack_mm(x[i], w, scale[i]) if dtype == torch.int8 else
                           left_product(x[i], w, None) if left else F.linear(x[i], w) for i, w in enumerate(stack)])
                for stack, x, scale in zip(stacks, rows, scales)]

    def sums(rows):  # summed_product's form: W_ij converted and multiplied inside the sum over j, in fp32
        out = []
        for stack, x, scale in zip(stacks, rows, scales):
            y = (stack.float() * stored(x.float())).sum(-1)
            out.append((y * scale.float() if dtype == torch.int8 else y).to(x.dtype))
        return out

    compiled = torch.compile(sums, dynamic=False)
    with torch.no_grad():
        for summed, kernel in zip(compiled(rows), kernels()):
            same(summed, kernel)
        ms = timed({"summed_ms": lambda: compiled(rows), "kernels_ms": kernels})
    return {"choice": ms["summed_ms"] < ms["kernels_ms"], **ms}


def measure_rows(quantized: Callable[[torch.nn.Linear, str], torch.nn.Module], megabytes: float = MEGABYTES / 2) -> dict:
    """torch's weight-only int8 and int4 kernels (qkv.nn.quant.QuantLinear, made by `quantized(linear, kind)`)
    with one row in bf16 against the row in fp32: {"choice": bf16 rows are the faster over both, ms}. (An
    AVX2-only EPYC without native bf16, 2026-12-07: 4.3 ms against 17.8 for int8, 4.3 against 32.0 for int4,
    over 20 MiB of weights: the kernels' bf16 path is the fast one also where bf16 is not native.)"""
    count = max(1, round(megabytes * 2 ** 20 / (2 * 1536 * 576)))
    torch.manual_seed(0)
    linears = [torch.nn.Linear(576, 1536, bias=False) if i % 2 == 0 else torch.nn.Linear(1536, 576, bias=False)
               for i in range(2 * count)]
    layers = [quantized(linear, kind) for kind in ("int8", "int4") for linear in linears]
    xs = {k: torch.randn(1, k) for k in (576, 1536)}

    def rows(dtype):
        def run():
            for layer in layers:
                layer.compute_dtype = dtype
            return [layer(xs[layer.in_features]) for layer in layers]
        return run

    with torch.no_grad():
        for y16, y32 in zip(rows(torch.bfloat16)(), rows(None)()):
            same(y16, y32)
        ms = timed({"bf16_rows_ms": rows(torch.bfloat16), "fp32_rows_ms": rows(None)})
    return {"choice": ms["bf16_rows_ms"] < ms["fp32_rows_ms"], **ms}


def measure_dense(rows: int = 128, megabytes: float = 2) -> dict:
    """A prompt's dense product, `rows` rows through SmolLM2-shaped matrices (weights(), `megabytes` of fp32),
    in bf16 against fp32: {"choice": bf16 is the faster, ms}. (An AVX2-only EPYC without native bf16,
    2026-12-07: torch's bf16 product is emulated there, Gemma 3's 500-token prefill 14x slower in bf16.)"""
    ws = [w for stack in weights(torch.float32, megabytes) for w in stack]
    xs = {k: torch.randn(rows, k) for k in (576, 1536)}
    ws16, xs16 = [w.bfloat16() for w in ws], {k: x.bfloat16() for k, x in xs.items()}
    with torch.no_grad():
        same(F.linear(xs16[576], ws16[0]), F.linear(xs[576], ws[0]))
        ms = timed({"bf16_ms": lambda: [F.linear(xs16[w.shape[1]], w) for w in ws16],
                    "fp32_ms": lambda: [F.linear(xs[w.shape[1]], w) for w in ws]})
    return {"choice": ms["bf16_ms"] < ms["fp32_ms"], **ms}


def measure_native(native: Callable, grouped: Callable, megabytes: float = MEGABYTES / 2) -> dict:
    """int8g's one-row product, Gemma 3's gate/up (2,048 x 640, groups of 32) and down (640 x 2,048, groups of
    16) shapes, `megabytes` of codes: grouped.c's loops, `native(x, codes, scale_t, low)` with an fp32 row,
    against torch's int8 kernel group by group, `grouped(x, codes, scale_t, low, ones)` with a bf16 row:
    {"choice": the loops are the faster, ms}. (An AVX2-only EPYC, 2026-12-07: see qkv.nn.grouped.)"""
    shapes = [(2048, 640, 32), (640, 2048, 16)]
    count = max(1, round(megabytes * 2 ** 20 / sum(n * k for n, k, _ in shapes)))
    generator = torch.Generator().manual_seed(0)
    layers = []
    for _ in range(count):
        for n, k, g in shapes:
            codes = torch.randint(-127, 128, (k // g, n, g), dtype=torch.int8, generator=generator)
            layers.append((codes, torch.rand(k // g, n, generator=generator) / 64, torch.ones(n, dtype=torch.bfloat16)))
    xs = {k: torch.randn(1, k, generator=generator) for _, k, _ in shapes}

    def rows(codes: torch.Tensor) -> torch.Tensor:
        return xs[codes.shape[0] * codes.shape[2]]
    with torch.no_grad():
        codes, scale_t, ones = layers[0]
        same(native(rows(codes), codes, scale_t, None), grouped(rows(codes).bfloat16(), codes, scale_t, None, ones))
        ms = timed({"native_ms": lambda: [native(rows(c), c, s, None) for c, s, _ in layers],
                    "grouped_ms": lambda: [grouped(rows(c).bfloat16(), c, s, None, o) for c, s, o in layers]})
    return {"choice": ms["native_ms"] < ms["grouped_ms"], **ms}


def measure_narrow(native: Callable, rows: int = 6, megabytes: float = MEGABYTES / 4) -> dict:
    """int8g's product of a short prompt's `rows` rows by grouped.c's loops, `native(x, codes, scale_t, low,
    narrow)`, the rows rounded to int16 by groups (narrow) against the rows in fp32, over Gemma 3's gate/up and
    down shapes (groups of 32 and 16), `megabytes` of codes: {"choice": narrow is the faster, ms}."""
    shapes = [(2048, 640, 32), (640, 2048, 16)]
    count = max(1, round(megabytes * 2 ** 20 / sum(n * k for n, k, _ in shapes)))
    generator = torch.Generator().manual_seed(0)
    layers = [(torch.randint(-127, 128, (k // g, n, g), dtype=torch.int8, generator=generator).transpose(0, 1)
               .contiguous().transpose(0, 1), torch.rand(k // g, n, generator=generator) / 64)
              for _ in range(count) for n, k, g in shapes]  # (the codes row after row, as grouped_layout holds them)
    xs = {k: torch.randn(rows, k, generator=generator) for _, k, _ in shapes}
    with torch.no_grad():
        codes, scale_t = layers[0]
        x = xs[codes.shape[0] * codes.shape[2]]
        same(native(x, codes, scale_t, None, True), native(x, codes, scale_t, None, False))
        ms = timed({f"{name}_ms": lambda narrow=narrow: [native(xs[c.shape[0] * c.shape[2]], c, s, None, narrow)
                                                         for c, s in layers]
                    for name, narrow in (("narrow", True), ("fp32", False))})
    return {"choice": ms["narrow_ms"] < ms["fp32_ms"], **ms}


def measure_native_int4(native: Callable, megabytes: float = MEGABYTES / 4) -> dict:
    """int4's one-row product, SmolLM2's 1,536 x 576 and 576 x 1,536 shapes, `megabytes` of packed codes:
    grouped.c's loops, `native(x, packed, scale, low)` with an fp32 row, against torch's int4 kernel with a bf16
    row (the operands qkv.nn.quant's int4 layer makes for it): {"choice": the loops are the faster, ms}."""
    shapes = [(1536, 576), (576, 1536)]
    count = max(1, round(megabytes * 2 ** 20 / sum(n * k // 2 for n, k in shapes)))
    generator = torch.Generator().manual_seed(0)
    layers = []
    for _ in range(count):
        for n, k in shapes:
            codes = torch.randint(0, 16, (n, k), dtype=torch.int32, generator=generator)
            scale, low = torch.rand(n, k // 32, generator=generator) / 64, torch.randn(n, k // 32, generator=generator) / 8
            packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8)
            kernel = torch._convert_weight_to_int4pack_for_cpu(codes, 1)
            zeros = torch.stack((scale.t(), (low + 8 * scale).t()), dim=-1).contiguous().bfloat16()
            layers.append((packed, scale, low, kernel, zeros))
    xs = {k: torch.randn(1, k, generator=generator) for _, k in shapes}
    with torch.no_grad():
        packed, scale, low, kernel, zeros = layers[0]
        x = xs[packed.shape[1] * 2]
        same(native(x, packed, scale, low), torch._weight_int4pack_mm_for_cpu(x.bfloat16(), kernel, 32, zeros))
        ms = timed({"native_ms": lambda: [native(xs[p.shape[1] * 2], p, s, m) for p, s, m, _, _ in layers],
                    "torch_ms": lambda: [torch._weight_int4pack_mm_for_cpu(xs[p.shape[1] * 2].bfloat16(), c, 32, z)
                                         for p, _, _, c, z in layers]})
    return {"choice": ms["native_ms"] < ms["torch_ms"], **ms}
