"""Properties the math guarantees, checked on the reference engine (STYLE.md 13), and its independence
from torch."""
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from qkv.ref import gradcheck
from qkv.ref.attention import repeat_kv
from qkv.ref.ffn import FFNS
from qkv.ref.flash import flash_backward, flash_forward
from qkv.ref.kernels import naive_backward, naive_forward
from qkv.ref.linear_attention import linear_explicit, linear_forward
from qkv.ref.moe import moe_forward
from qkv.ref.positional import Rotary

SRC = Path(__file__).resolve().parents[2] / "src"


@settings(max_examples=15, deadline=None)
@given(t=st.integers(1, 9), s_extra=st.integers(0, 4), block=st.integers(1, 5), causal=st.booleans(),
       seed=st.integers(0, 2 ** 16))
def test_flash_equals_naive_forward_and_backward(t, s_extra, block, causal, seed):
    """Claim 18: any tile size, any T <= S (queries aligned to the last T keys), causal or not."""
    rng = np.random.default_rng(seed)
    s = t + s_extra
    q, dout = rng.normal(size=(1, 2, t, 4)), rng.normal(size=(1, 2, t, 4))
    k, v = rng.normal(size=(1, 2, s, 4)), rng.normal(size=(1, 2, s, 4))
    kw = dict(mask=None, causal=causal, bias=None, scale=0.5)
    out_n, cache_n = naive_forward(q, k, v, **kw)
    out_f, cache_f = flash_forward(q, k, v, **kw, block=block)
    np.testing.assert_allclose(out_f, out_n, rtol=0, atol=1e-13)
    for a, b in zip(flash_backward(dout, cache_f)[:3], naive_backward(dout, cache_n)[:3]):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-13)


def test_flash_claim_18_helper():
    result = gradcheck.flash_matches_naive()
    assert result["forward"] < 1e-13 and result["backward"] < 1e-13


def test_flash_extra_memory_is_linear_and_naive_quadratic():
    """Peak NumPy allocations of forward + backward: naive grows ~4x per doubling of n, flash ~2x."""
    naive = [gradcheck.attention_peak_bytes("naive", n, d=16, block=32) for n in (128, 256)]
    flash = [gradcheck.attention_peak_bytes("flash", n, d=16, block=32) for n in (128, 256)]
    assert naive[1] / naive[0] > 3.5
    assert flash[1] / flash[0] < 2.3
    assert flash[1] < naive[1] / 4


@settings(max_examples=10, deadline=None)
@given(causal=st.booleans(), seed=st.integers(0, 2 ** 16))
def test_linear_attention_equals_its_explicit_form(causal, seed):
    """Claim 17: the O(n d^2) prefix-sum form equals the O(n^2) form with weights phi(q_i) . phi(k_j)."""
    rng = np.random.default_rng(seed)
    q, k, v = (rng.normal(size=(2, 2, 6, 3)) for _ in range(3))
    out, _ = linear_forward(q, k, v, mask=None, causal=causal, bias=None, scale=1.0)
    np.testing.assert_allclose(out, linear_explicit(q, k, v, causal), rtol=0, atol=1e-13)


def test_rope_scores_depend_only_on_relative_position():
    """Claim 5 on the reference RoPE: q~_m . k~_n is unchanged when both positions shift together."""
    rope = Rotary(SimpleNamespace(head_dim=8, rope_theta=10000.0))
    rng = np.random.default_rng(0)
    q, k = rng.normal(size=(1, 1, 1, 8)), rng.normal(size=(1, 1, 1, 8))
    scores = []
    for shift in (0, 7, 100):
        q_rot, _, _ = rope.rotate_forward(q, q, np.array([[3 + shift]]))
        _, k_rot, _ = rope.rotate_forward(k, k, np.array([[5 + shift]]))
        scores.append(float((q_rot * k_rot).sum()))
    np.testing.assert_allclose(scores, scores[0], rtol=1e-12)


def test_rope_backward_is_rotation_by_minus_theta():
    rope = Rotary(SimpleNamespace(head_dim=4, rope_theta=10000.0))
    x = np.random.default_rng(1).normal(size=(1, 1, 3, 4))
    positions = np.array([[0, 1, 2]])
    rotated, _, cache = rope.rotate_forward(x, x, positions)
    back, _ = rope.rotate_backward(rotated, rotated, cache)
    np.testing.assert_allclose(back, x, atol=1e-15)  # R_{-m} R_m = I, and the backward is R_{-m}


def test_moe_with_one_expert_equals_the_dense_ffn():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(2, 3, 8))
    dense = {"up_proj.weight": rng.normal(size=(12, 8)), "up_proj.bias": rng.normal(size=12),
             "down_proj.weight": rng.normal(size=(8, 12)), "down_proj.bias": rng.normal(size=8)}
    moe = {"router.weight": rng.normal(size=(1, 8)), **{f"experts.0.{k}": v for k, v in dense.items()}}
    y_moe, cache = moe_forward(moe, x, ffn="mlp", activation="gelu", experts=1, top_k=1)
    y_dense, _ = FFNS.get("mlp").forward(dense, x, "gelu")
    np.testing.assert_allclose(y_moe, y_dense, atol=1e-14)
    assert cache.aux == 1.0  # E * f * P = 1 * 1 * 1: one expert is perfectly "balanced"


def test_gqa_with_all_heads_is_mha():
    kv = np.random.default_rng(0).normal(size=(2, 3, 4, 5))
    assert repeat_kv(kv, 1) is kv
    grouped = repeat_kv(kv, 2)  # 3 K/V heads serving 6 query heads: head h reads kv head h // 2
    np.testing.assert_array_equal(grouped[:, 4], kv[:, 2])


def test_reference_engine_runs_without_torch():
    """qkv.ref imports numpy only: with torch made unimportable (and qkv/__init__, which builds torch
    models, bypassed), a training step and the gradient checks still run."""
    script = f"""
import sys, types, importlib.abc
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError("torch is blocked")
sys.meta_path.insert(0, Block())
package = types.ModuleType("qkv"); package.__path__ = [{str(SRC / 'qkv')!r}]; sys.modules["qkv"] = package
import numpy as np
from qkv.config import RunConfig, ModelConfig, TrainConfig
from qkv.ref import train_ref, gradcheck
from qkv.ref.model import forward
cfg = RunConfig(model=ModelConfig(vocab_size=11, d_model=8, n_heads=2, n_layers=1, d_ff=12, max_seq_len=8),
                train=TrainConfig(warmup_steps=1))
rng = np.random.default_rng(0)
shapes = {{"tok_emb.weight": (11, 8), "positional.weight": (8, 8), "final_norm.weight": (8,), "final_norm.bias": (8,)}}
for part in ("attn_norm", "ffn_norm"):
    shapes.update({{f"blocks.0.{{part}}.weight": (8,), f"blocks.0.{{part}}.bias": (8,)}})
for proj in "qkvo":
    shapes.update({{f"blocks.0.attn.{{proj}}_proj.weight": (8, 8), f"blocks.0.attn.{{proj}}_proj.bias": (8,)}})
shapes.update({{"blocks.0.ffn.up_proj.weight": (12, 8), "blocks.0.ffn.up_proj.bias": (12,),
               "blocks.0.ffn.down_proj.weight": (8, 12), "blocks.0.ffn.down_proj.bias": (8,)}})
params = {{n: rng.normal(scale=0.3, size=s) for n, s in shapes.items()}}
batch = rng.integers(0, 11, (2, 2, 5))
losses = train_ref(params, cfg, [batch, batch, batch], 3)
assert losses[2] < losses[0], losses
assert all(c.passed for c in gradcheck.check_fd("norm_layernorm"))
assert "torch" not in sys.modules
print("ok")
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert result.stdout.strip() == "ok", result.stderr[-2000:]
