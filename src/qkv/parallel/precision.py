"""Mixed precision (note 000 LLM §6.2): autocast of the forward in bf16 or fp16. The weights and the
optimizer stay fp32 (master weights); fp16's dynamic loss scale is torch's GradScaler in the Trainer."""
from __future__ import annotations

import contextlib
import dataclasses

import torch

from qkv import hardware
from qkv.config import RunConfig


def autocast(device: torch.device, precision: str):
    """train.precision: fp32 runs as is; bf16 / fp16 autocast the matmuls (softmax, norms and the loss
    compute in fp32 inside the model)."""
    if precision == "fp32":
        return contextlib.nullcontext()
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    return torch.autocast(device_type=device.type, dtype=dtype)


def resolve(precision: str, device: torch.device) -> tuple[str, str]:
    """train.precision on `device`: auto becomes bf16 where the device multiplies bf16 natively (qkv.hardware),
    fp32 elsewhere; (the precision, why). Any other value is kept as given."""
    if precision != "auto":
        return precision, "as configured"
    cuda_bf16 = device.type == "cuda" and torch.cuda.is_bf16_supported(including_emulation=False)
    return hardware.auto_precision(device.type, cuda_bf16=cuda_bf16, cpu_flag=hardware.native_bf16_cpu())


def resolved(cfg: RunConfig, device: torch.device) -> tuple[RunConfig, str | None]:
    """`cfg` with train.precision=auto replaced by what it means on `device`, and the line that says so
    (None when the precision was given)."""
    if cfg.train.precision != "auto":
        return cfg, None
    chosen, why = resolve("auto", device)
    line = (f"qkv: train.precision=auto -> {chosen}: {why} "
            f"(--set train.precision={'fp32' if chosen == 'bf16' else 'bf16'} to override)")
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, precision=chosen)), line
