"""Where torch's fused Adam/AdamW kernel applies (`fused=True`: one pass over each parameter, its moments and
its gradient), shared by qkv.train.optim's Adam and AdamW and the AdamW half of qkv.train.muon."""
from __future__ import annotations

import torch
from torch import nn

FUSED_DEVICES = ("cpu", "cuda")


def fused_applies(groups: list[dict]) -> bool:
    """torch's fused Adam/AdamW kernel takes plain floating-point tensors on CPU or CUDA (a pipeline's meta
    parameters of other stages never get a gradient, so never reach it)."""
    params = [p for group in groups for p in group["params"] if not p.is_meta]  # meta: another stage's, no step
    return bool(params) and all(type(p) in (nn.Parameter, torch.Tensor) and p.is_floating_point()
                                and p.device.type in FUSED_DEVICES for p in params)
