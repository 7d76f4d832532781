"""qkv.claims.attention (claims 1, 2, 6, 7, 15-20): the measured figures against closed forms: Var(q.k) = d_k,
multi-head FLOPs 4 n^2 d, local's and linear's costs 4 n (w-window) d and 4 n d^2 + 2 n d, flash's saved bytes
linear in n, one FLOP = two multiply-adds, backward = 2 x forward."""
from tests.claims import measured


def test_claim_1_scaled_dot_products_have_unit_variance(verified):
    m = measured(verified, 1)
    for d_k in (16, 64, 256):
        # 20,000 samples: the sample variance's standard error is d_k sqrt((2 + 6 / d_k) / 20000) < 1.3% of d_k
        assert abs(m[f"d_k={d_k}"]["var_qk"] / d_k - 1) < 0.07
        assert abs(m[f"d_k={d_k}"]["var_scaled"] - 1) < 0.07
    weights = m["mean max softmax weight, 32 keys, d_k=256"]
    assert weights["unscaled"] > 0.8 and 1 / 32 < weights["scaled"] < 0.3  # saturated vs spread over 32 keys


def test_claim_2_heads_cost_4_n2_d_whatever_their_number(verified):
    m, n, d, h = measured(verified, 2), 128, 64, 8
    assert m["flops_1_head_width_d"] == m["flops_8_heads_width_d/8"] == m["formula_4n^2d"] == 4 * n * n * d
    assert m["note_h(n/h)^2_form_flops"] == 2 * h * ((n // h) ** 2 * (d // h) + (n // h) * (d // h) ** 2)


def test_claims_6_7_15_equivariance_row_wise_ffn_and_projections(verified):
    m6 = measured(verified, 6)
    assert m6["max|f(Px) - P f(x)| (no mask)"] < 1e-12 and m6["same with a causal mask"] > 0.1
    assert measured(verified, 7)["max|row by row - matrix|"] < 1e-12
    m15 = measured(verified, 15)
    assert m15["relative residual, random W"] > 0.1 and m15["relative residual, W_Q W_K^T = I"] < 1e-12


def test_claim_16_local_attention_is_linear_in_n(verified):
    m, d = measured(verified, 16), 16
    assert m["max|local - masked full|"] < 1e-12
    assert m["full flops n=256, 512"] == [4 * 256 ** 2 * d, 4 * 512 ** 2 * d]
    local = m["local flops n=256, 512"]
    assert local[1] == 2 * local[0] and local[0] < m["full flops n=256, 512"][0] / 10
    assert m["growth when n doubles (local, full)"] == [2.0, 4.0]


def test_claim_17_linear_attention_costs_4_n_d2(verified):
    m, n, d = measured(verified, 17), 512, 32
    assert max(m["max|O(n d^2) - explicit| causal=False"], m["max|O(n d^2) - explicit| causal=True"]) < 1e-12
    # phi(K)^T V and phi(Q)(.) are 2 n d^2 each, the normaliser phi(Q) . sum_j phi(k_j) 2 n d; explicit 4 n^2 d
    linear, explicit = m["torch kernel flops n=512: phi(Q)(phi(K)^T V) vs explicit (phi(Q)phi(K)^T) V"]
    assert linear == 4 * n * d * d + 2 * n * d and explicit == 4 * n * n * d


def test_claim_18_flash_saves_bytes_linear_in_n(verified):
    m = measured(verified, 18)
    assert max(m["max|flash - naive| (forward, backward)"].values()) < 1e-12
    naive, flash = m["torch: bytes saved for the backward n=256,512,1024 (naive, flash)"]
    assert flash[1] == 2 * flash[0] and flash[2] == 2 * flash[1]  # O(n): the output and row statistics
    assert naive[2] / naive[1] > 3.5  # O(n^2): the attention matrix
    numpy_naive, numpy_flash = m["peak bytes naive n=128,256,512"], m["peak bytes flash n=128,256,512"]
    assert numpy_naive[2] / numpy_naive[1] > 3.5 and numpy_flash[2] / numpy_flash[1] < 2.0


def test_claims_19_20_flops_are_twice_the_multiply_adds_and_backward_twice_forward(verified):
    m = measured(verified, 19)
    assert m["attention counted FLOPs"] == 2 * m["note 2n^2d + 4nd^2 (multiply-adds)"]
    assert m["FFN counted FLOPs"] == 2 * m["note 8nd^2 (multiply-adds)"]
    m = measured(verified, 20)
    assert m["backward FLOPs"] == 2 * m["forward FLOPs"]
