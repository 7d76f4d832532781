"""The bf16 output head of a quantized model on a CPU with native bf16 (qkv.nn.quant.head_kind)."""
from __future__ import annotations

import torch
from torch import Tensor, nn

from qkv.nn.decoding_linear import decode_rows, left_form_faster, left_product, summed_product, summed_rows


class Bf16Linear(nn.Module):
    """y = x W^T + b with W held in bf16 and the product taken in bf16, y in x's dtype: the output head of a
    quantized model on a CPU with native bf16. The head sets the logits directly: on SmolLM2 an int8 head alone
    moves them by KL 0.0008 nats per token (97.4% top-1 agreement with fp32) and a bf16 head by 0.00002
    (99.6%; benchmarks/real_decode.py's text), for twice the int8 head's bytes."""

    def __init__(self, weight: Tensor, bias: Tensor | None):
        super().__init__()
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        self.weight = nn.Parameter(weight.detach().to(torch.bfloat16).clone(), requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias.detach().to(torch.bfloat16).clone(),
                                                           requires_grad=False)
        # the decode step's form, decided once (a plain attribute: a constant where the step is compiled)
        object.__setattr__(self, "left_form", left_form_faster(torch.bfloat16))

    def forward(self, x: Tensor) -> Tensor:
        x16 = x.to(self.weight.dtype)
        if summed_rows(x16, self.weight):  # a compiled step's one row (qkv.nn.decoding_linear)
            return summed_product(x16, self.weight, self.bias).to(x.dtype)
        if self.left_form and decode_rows(x):  # a decode step's few rows (decoding_linear)
            bias = None if self.bias is None else self.bias[:, None]
            return left_product(x16, self.weight, bias).to(x.dtype)
        return torch.nn.functional.linear(x16, self.weight, self.bias).to(x.dtype)

    def extra_repr(self) -> str:
        return f"bf16, in_features={self.in_features}, out_features={self.out_features}"
