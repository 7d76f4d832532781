"""What this machine's processor multiplies natively: the evidence behind train.precision=auto.

A CPU multiplies bf16 matrices natively when it has AVX512-BF16 (AMD Zen 4 and later, Intel Cooper Lake) or
AMX-BF16 (Intel Sapphire Rapids and later) on x86, or the BF16 extension on Arm (Apple M2 and later, Graviton 3).
Elsewhere torch still runs bf16, by converting to fp32 around each product: slower than fp32, never chosen
automatically. Measured on the default job (docs/performance.md): with avx512_bf16, bf16 autocast trained
27-30% more tokens in 300 s and ended 0.02-0.04 bits/char lower than fp32.

No torch here: `qkv calc` and the config resolve `auto` without importing it.
"""
from __future__ import annotations

import functools
import platform
import subprocess
from pathlib import Path

X86_BF16_FLAGS = ("amx_bf16", "avx512_bf16")  # /proc/cpuinfo's names, the first found is reported
ARM_BF16_FEATURES = ("bf16",)  # /proc/cpuinfo "Features" on Linux aarch64


def cpu_flags(cpuinfo: str) -> set[str]:
    """The feature words of /proc/cpuinfo's first processor ("flags" on x86, "Features" on Arm)."""
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip().lower() in ("flags", "features"):
            return set(value.split())
    return set()


def native_bf16_from(cpuinfo: str) -> str | None:
    """The flag that says this CPU multiplies bf16 natively, or None."""
    flags = cpu_flags(cpuinfo)
    return next((flag for flag in X86_BF16_FLAGS + ARM_BF16_FEATURES if flag in flags), None)


@functools.cache
def native_bf16_cpu() -> str | None:
    """This machine's bf16 flag (see native_bf16_from), or None when its CPU would emulate bf16."""
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        try:
            return native_bf16_from(cpuinfo.read_text(errors="replace"))
        except OSError:
            return None
    if platform.system() == "Darwin" and platform.machine() == "arm64":  # Apple silicon: M2 and later
        try:
            answer = subprocess.run(["sysctl", "-n", "hw.optional.arm.FEAT_BF16"], capture_output=True, text=True,
                                    timeout=5).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return None
        return "FEAT_BF16" if answer == "1" else None
    return None


def cpu_model_from(cpuinfo: str) -> str | None:
    """/proc/cpuinfo's "model name" of the first processor, or None."""
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip().lower() == "model name":
            return value.strip() or None
    return None


@functools.cache
def cpu_model() -> str | None:
    """This machine's CPU model (cpu_model_from), or None where /proc/cpuinfo does not say."""
    try:
        return cpu_model_from(Path("/proc/cpuinfo").read_text(errors="replace"))
    except OSError:
        return None


def auto_precision(device_type: str, *, cuda_bf16: bool = False, cpu_flag: str | None = None) -> tuple[str, str]:
    """train.precision=auto on this device: (the precision, why). bf16 autocast where the device multiplies
    bf16 natively (a CUDA card that supports it; a CPU with `cpu_flag`), fp32 elsewhere."""
    if device_type == "cuda":
        if cuda_bf16:
            return "bf16", "this GPU multiplies bf16 natively"
        return "fp32", "this GPU does not support bf16"
    if device_type == "cpu":
        if cpu_flag:
            return "bf16", f"this CPU multiplies bf16 natively ({cpu_flag})"
        return "fp32", "this CPU has no native bf16 (no avx512_bf16, amx_bf16 or Arm bf16), so bf16 would be emulated"
    return "fp32", f"bf16 autocast is chosen automatically only on CPUs and CUDA GPUs, not on {device_type}"
