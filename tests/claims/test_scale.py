"""qkv.claims.scale (claims 23-25) against closed forms: GPT-3's parameter count 12 L d^2 + 13 L d + (V + n) d
+ 2 d, 6ND, bytes per parameter, ZeRO's per-GPU memory (2 + 2 + K) psi split by stage, Chinchilla's ratio."""
import pytest

from tests.claims import measured


def test_claim_23_gpt3_parameters_flops_and_memory(verified):
    m = measured(verified, 23)
    L, d, V, n = 96, 12288, 50257, 2048
    params = 12 * L * d * d + 13 * L * d + (V + n) * d + 2 * d  # blocks (weights, biases, norms), tables, final LN
    assert m["parameters (qkv.analysis.params)"] == params and m["12 L d^2"] == 12 * L * d * d
    assert m["6ND, N=175e9, D=300e9"] == pytest.approx(6 * 175e9 * 300e9)
    assert m["6ND with the counted N"] == pytest.approx(6 * params * 300e9)
    assert m["mixed precision GB (fp16 weights, fp16 grads, fp32 master, fp32 m+v)"] == pytest.approx(
        [2 * params / 1e9, 2 * params / 1e9, 4 * params / 1e9, 8 * params / 1e9], abs=0.06)
    assert m["mixed precision total GB (16 bytes/param)"] == pytest.approx(16 * params / 1e9, abs=0.06)
    assert m["note's batch: 512 x 2048 tokens"] == 512 * 2048


def test_claim_24_zero_stages(verified):
    m, psi, K = measured(verified, 24), 7.5e9, 12  # Rajbhandari et al.: fp16 weights and grads, K = 12 states
    for N in (64,):
        expected = [(2 + 2 + K) * psi, 2 * psi + 2 * psi + K * psi / N, 2 * psi + (2 + K) * psi / N,
                    (2 + 2 + K) * psi / N]
        assert m["GB per GPU, stage 0-3, psi=7.5B, N=64"] == pytest.approx([e / 1e9 for e in expected], abs=0.06)
    for N in (64, 1024, 1_000_000):
        ratios = [16 / (4 + K / N), 16 / (2 + 14 / N), N]
        assert m[f"reduction stage 1, 2, 3 at N={N}"] == pytest.approx(ratios, abs=0.006)
    assert m["fp32 Adam, N=1e6: reduction stage 1, 2"] == pytest.approx([2.0, 4.0], abs=0.01)  # 16 / 8, 16 / 4


def test_claim_25_chinchilla_tokens_per_parameter(verified):
    m = measured(verified, 25)
    assert m["Chinchilla 70B on 1.4T tokens"] == pytest.approx(1.4e12 / 70e9)
    refit = m["refit (Besiroglu et al. 2024) at C=5.76e23"]
    assert refit["tokens_per_param"] == pytest.approx(refit["tokens"] / refit["params"], abs=0.05)
    assert 6 * refit["params"] * refit["tokens"] == pytest.approx(5.76e23, rel=1e-3)  # C = 6 N D on the frontier
    assert all(15 < v < 25 for v in m["refit tokens/param at C=1e21, 1e23, 1e25"].values())
