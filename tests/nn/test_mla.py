"""qkv.nn.mla: the per-head form (a call without a cache) and the absorbed form (a call into the latent cache)
are one function: a sequence fed whole, and in pieces through the cache, gives the same logits in float64; the
cache holds the latent and the RoPE key alone."""
import torch

from qkv.config import ModelConfig
from qkv.models import build_model

CFG = ModelConfig(vocab_size=50, d_model=32, n_heads=4, n_layers=2, d_ff=48, positional="rope", norm="rmsnorm",
                  ffn="glu", activation="silu", bias=False, head_size=12, mla_kv_rank=16, mla_q_rank=8,
                  mla_rope_dims=4, mla_v_dims=10)


def test_the_absorbed_cache_path_equals_the_per_head_pass():
    torch.manual_seed(0)
    model = build_model(CFG).double().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.3)
    ids = torch.randint(0, 50, (2, 11))
    with torch.no_grad():
        whole = model(ids)
        cache = model.new_cache(2, 16)
        pieces = torch.cat([model(ids[:, :6], cache=cache)] + [model(ids[:, t:t + 1], cache=cache) for t in range(6, 11)], 1)
    torch.testing.assert_close(pieces, whole, rtol=0, atol=1e-12)
    assert cache.layers[0].k.shape == (2, 1, 16, 16 + 4) and cache.layers[0].v.numel() == 0


def test_the_compiled_step_refuses_moe_and_latent_attention_with_its_reason():
    """Each step routes to other experts: the compiled step (one graph over fixed weights) says so, and --compile
    is refused in one line rather than compiled and abandoned."""
    from qkv.config import ModelConfig
    from qkv.generate.compiled import unsupported
    from qkv.models import build_model

    model = build_model(ModelConfig(vocab_size=50, d_model=16, n_heads=2, n_layers=2, d_ff=24, positional="rope",
                                    moe_experts=4, moe_top_k=2, moe_dense_layers=(0,)))
    assert unsupported(model) == "a mixture-of-experts layer"
    latent = build_model(ModelConfig(vocab_size=50, d_model=16, n_heads=2, n_layers=2, d_ff=24, positional="rope",
                                     head_size=6, mla_kv_rank=5, mla_rope_dims=2))
    assert unsupported(latent).startswith("latent attention")
