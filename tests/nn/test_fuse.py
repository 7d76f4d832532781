"""qkv.nn.fuse: Q/K/V and gate/up as one product give the separate products' logits (fp32 and quantized), hold
no second copy of any weight, keep the state dict, and step aside for a hook on a separate layer."""
import pytest
import torch

from qkv.config import ModelConfig
from qkv.generate import generate
from qkv.models import build_model
from qkv.nn.fuse import fuse, fuse_projections
from qkv.nn.quant import QuantLinear, quantize_model

LLAMA = ModelConfig(vocab_size=97, d_model=64, n_heads=4, n_kv_heads=2, n_layers=2, d_ff=96, max_seq_len=64,
                    positional="rope", norm="rmsnorm", ffn="glu", activation="silu", bias=False, dropout=0.0)
GPT2 = ModelConfig(vocab_size=97, d_model=64, n_heads=4, n_layers=2, d_ff=128, max_seq_len=64, dropout=0.0)


def pair(cfg: ModelConfig, quant: str = "none"):
    torch.manual_seed(0)
    a = build_model(cfg).eval()
    b = build_model(cfg).eval()
    b.load_state_dict(a.state_dict())
    for model in (a, b):
        if quant != "none":
            quantize_model(model, quant)
            for module in model.modules():
                if hasattr(module, "compute_dtype"):
                    module.compute_dtype = None  # fp32 products: compared to 1e-5
    return a, b


@pytest.mark.parametrize("cfg, quant, groups", [(LLAMA, "none", 4), (GPT2, "none", 2), (LLAMA, "int8", 4),
                                                (LLAMA, "int4", 4)])
def test_fused_projections_give_the_same_logits(cfg, quant, groups):
    plain, fused = pair(cfg, quant)
    assert fuse_projections(fused) == groups  # one Q/K/V per layer, and a gate/up per GLU layer
    ids = torch.randint(0, 97, (2, 12))
    with torch.no_grad():
        assert torch.allclose(plain(ids), fused(ids), rtol=1e-5, atol=1e-5)
        assert torch.equal(generate(plain, ids[:1, :4], max_new_tokens=6), generate(fused, ids[:1, :4], max_new_tokens=6))


def test_fusion_holds_each_weight_once_and_keeps_the_state_dict():
    plain, fused = pair(LLAMA)
    names = list(plain.state_dict())
    fuse_projections(fused)
    assert list(fused.state_dict()) == names
    attn = fused.blocks[0].attn
    one = attn.__dict__["fused_qkv"]
    storage = one.weight.untyped_storage().data_ptr()
    assert all(layer.weight.untyped_storage().data_ptr() == storage for layer in (attn.q_proj, attn.k_proj, attn.v_proj))


def test_a_hook_on_a_separate_layer_sees_it_run():
    plain, fused = pair(LLAMA)
    fuse_projections(fused)
    seen = []
    fused.blocks[1].attn.k_proj.register_forward_hook(lambda module, args, out: seen.append(out.shape))
    fused.blocks[0].ffn.up_proj.register_forward_hook(lambda module, args, out: seen.append(out.shape))
    ids = torch.randint(0, 97, (1, 5))
    with torch.no_grad():
        assert torch.allclose(plain(ids), fused(ids), rtol=1e-5, atol=1e-5)
    assert seen == [(1, 5, 96), (1, 5, 32)]  # the up projection of layer 0, the K projection of layer 1


@pytest.mark.parametrize("native, narrow", [(True, True), (True, False), (False, False)])
def test_a_fused_file_layer_takes_its_parts_forms_and_their_products(native, narrow):
    """int8g parts (a GGUF file's blocks) told their forms (grouped.c's loops, a prompt's rows narrow) make a
    fused layer of the same forms, whose prompt product is the parts' side by side bit for bit."""
    generator = torch.Generator().manual_seed(5)
    parts = []
    for n in (48, 16):
        codes = torch.randint(-128, 128, (n, 64), dtype=torch.int8, generator=generator)
        layer = QuantLinear.from_codes(codes, torch.rand(n, 2, generator=generator), None, None)
        layer.compute_dtype, layer.native, layer.narrow = None, native, narrow
        parts.append(layer)
    x = torch.randn(1, 5, 64, generator=generator)
    with torch.no_grad():
        want = torch.cat([layer(x) for layer in parts], -1)
        one = fuse(parts)
        assert (one.native, one.narrow) == (native, narrow)
        assert torch.equal(one(x), want)
