"""Mixed precision (note 000 LLM §6.2): autocast of the forward in bf16 or fp16. The weights and the
optimizer stay fp32 (master weights); fp16's dynamic loss scale is torch's GradScaler in the Trainer."""
from __future__ import annotations

import contextlib

import torch


def autocast(device: torch.device, precision: str):
    """train.precision: fp32 runs as is; bf16 / fp16 autocast the matmuls (softmax, norms and the loss
    compute in fp32 inside the model)."""
    if precision == "fp32":
        return contextlib.nullcontext()
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    return torch.autocast(device_type=device.type, dtype=dtype)
