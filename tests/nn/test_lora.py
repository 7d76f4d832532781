"""LoRA (qkv.nn.lora): the adapted layer's function, its gradients against the closed forms, merging, the spec."""
import dataclasses

import pytest
import torch
from torch import nn

from qkv.config import ModelConfig
from qkv.errors import QkvError
from qkv.models import build_model
from qkv.nn.lora import (LoRALinear, LoraSpec, adapters, adapters_off, apply_lora, merge_lora, parse_spec,
                         trainable_count)
from qkv.nn.quant import QuantLinear


def layer(spec=LoraSpec(r=3, alpha=6.0, dropout=0.0)):
    torch.manual_seed(0)
    base = nn.Linear(8, 5)
    lora = LoRALinear(base, spec)
    with torch.no_grad():
        lora.lora_B.weight.normal_()  # B = 0 at the start: give it values for the checks to see it
    return base, lora


def test_forward_is_w_x_plus_scaled_b_a_x():
    base, lora = layer()
    x = torch.randn(4, 8)
    expected = x @ base.weight.T + base.bias + 2.0 * x @ lora.lora_A.weight.T @ lora.lora_B.weight.T
    torch.testing.assert_close(lora(x), expected, rtol=1e-6, atol=1e-6)


def test_gradients_equal_the_closed_forms():
    """dL/dB = s g (A x)^T, dL/dA = s B^T g x^T, dL/dx = W^T g + s A^T B^T g; W frozen (no gradient)."""
    base, lora = layer()
    x = torch.randn(4, 8, requires_grad=True)
    g = torch.randn(4, 5)
    (lora(x) * g).sum().backward()
    A, B, W, s = lora.lora_A.weight, lora.lora_B.weight, base.weight, 2.0
    torch.testing.assert_close(lora.lora_B.weight.grad, s * g.T @ (x @ A.T), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(lora.lora_A.weight.grad, s * (g @ B).T @ x, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(x.grad, g @ W + s * g @ B @ A, rtol=1e-5, atol=1e-6)
    assert base.weight.grad is None and not base.weight.requires_grad


def test_a_fresh_adapter_is_the_model_itself_and_merging_keeps_the_function(tiny_cfg):
    cfg = dataclasses.replace(tiny_cfg, positional="rope", norm="rmsnorm", ffn="glu", activation="silu")
    torch.manual_seed(0)
    model = build_model(cfg).eval()
    ids = torch.randint(0, cfg.vocab_size, (2, 9))
    before = model(ids)
    names = apply_lora(model, parse_spec("r=2,alpha=4,dropout=0,targets=all-linear"))
    assert len(names) == cfg.n_layers * 7 and "lm_head" not in " ".join(names)
    torch.testing.assert_close(model(ids), before, rtol=0, atol=0)  # B = 0
    for adapter in adapters(model).values():
        nn.init.normal_(adapter.lora_B.weight, std=0.1)
    adapted = model(ids)
    assert (adapted - before).abs().max() > 1e-3
    with adapters_off(model):
        torch.testing.assert_close(model(ids), before, rtol=0, atol=0)  # DPO's reference: no second copy
    trainable, total = trainable_count(model)
    assert trainable == sum(a.lora_A.weight.numel() + a.lora_B.weight.numel() for a in adapters(model).values())
    assert merge_lora(model) == len(names) and not adapters(model)
    torch.testing.assert_close(model(ids), adapted, rtol=1e-5, atol=1e-5)


def test_only_the_named_targets_are_adapted(tiny_cfg):
    model = build_model(tiny_cfg)
    names = apply_lora(model, parse_spec("r=4,targets=q,v"))
    assert sorted({n.rpartition(".")[2] for n in names}) == ["q_proj", "v_proj"]
    assert all(not p.requires_grad for n, p in model.named_parameters() if ".lora_" not in n)


def test_a_quantized_base_trains_its_adapters(tiny_cfg):
    """QLoRA: the frozen base an int8 QuantLinear; gradients reach the adapters and the input."""
    torch.manual_seed(0)
    base = nn.Linear(64, 16)
    quant = QuantLinear.from_linear(base, "int8")
    lora = LoRALinear(quant, LoraSpec(r=4, alpha=8.0, dropout=0.0))
    nn.init.normal_(lora.lora_B.weight)
    x = torch.randn(3, 64, requires_grad=True)
    g = torch.randn(3, 16)
    (lora(x) * g).sum().backward()
    merged = (quant.weight + lora.delta()).detach()  # (16, 64): what the layer computes
    tolerance = dict(rtol=2e-2, atol=5e-2)  # the products run in bf16 where the CPU has it
    torch.testing.assert_close(lora(x.detach()), x.detach() @ merged.T + quant.bias, **tolerance)
    torch.testing.assert_close(x.grad, g @ merged, **tolerance)  # dL/dx through the quantized base: g W
    torch.testing.assert_close(lora.lora_B.weight.grad, 2.0 * g.T @ (x.detach() @ lora.lora_A.weight.T).detach(),
                               **tolerance)


@pytest.mark.parametrize("text, message", [
    ("r=0", "r=0 must be a positive integer"),
    ("r=4,alpha=-1", "alpha=-1.0 must be a positive number"),
    ("r=4,dropout=1.5", "dropout=1.5 must be in [0, 1)"),
    ("r=4,targets=q,lm_head", "target 'lm_head'"),
    ("r=4,rank=3", "unknown field 'rank'"),
    ("r=four", "invalid literal"),
    ("16", "is not NAME=VALUE"),
])
def test_bad_specs_name_the_field(text, message):
    with pytest.raises(QkvError, match=message.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        parse_spec(text)


def test_the_spec_reads_back_as_written():
    spec = parse_spec("r=8,alpha=16,dropout=0.1,targets=q,k,v,rslora=true")
    assert spec == LoraSpec(r=8, alpha=16.0, dropout=0.1, targets=("q", "k", "v"), rslora=True)
    assert parse_spec(spec.to_text()) == spec and spec.scaling == pytest.approx(16 / 8 ** 0.5)
