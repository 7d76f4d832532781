"""qkv.rope_scaling against transformers' own RoPE initialisation functions (modeling_rope_utils'
ROPE_INIT_FUNCTIONS): the frequencies and the attention factor of linear, llama3 (Llama 3.1 and 3.2's
settings) and YaRN (Qwen's long context), over head widths and bases; and the closed forms the docs derive."""
import math

import numpy as np
import pytest
import torch

from qkv.rope_scaling import RopeScaling, base_frequencies, frequencies

transformers = pytest.importorskip("transformers")
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: E402

CASES = [  # (qkv scaling, HF rope_parameters)
    (RopeScaling("linear", 4.0), {"rope_type": "linear", "factor": 4.0}),
    (RopeScaling("llama3", 8.0, 8192, 1.0, 4.0), {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                  "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
    (RopeScaling("llama3", 32.0, 8192, 1.0, 4.0), {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                                   "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
    (RopeScaling("yarn", 4.0, 32768), {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}),
    (RopeScaling("yarn", 40.0, 4096, beta_fast=16.0, beta_slow=2.0),
     {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096, "beta_fast": 16.0, "beta_slow": 2.0}),
]


@pytest.mark.parametrize("head_dim, base", [(64, 500000.0), (128, 1000000.0), (32, 10000.0)])
@pytest.mark.parametrize("case", range(len(CASES)), ids=[c[1]["rope_type"] + str(i) for i, c in enumerate(CASES)])
def test_frequencies_equal_transformers(case, head_dim, base):
    ours, params = CASES[case]
    config = transformers.LlamaConfig(hidden_size=head_dim * 4, num_attention_heads=4, head_dim=head_dim,
                                      max_position_embeddings=max(ours.original_context, 1) * int(ours.factor),
                                      rope_parameters={**params, "rope_theta": base})
    expected, factor = ROPE_INIT_FUNCTIONS[params["rope_type"]](config, "cpu")
    theta, m = frequencies(head_dim, base, ours)
    torch.testing.assert_close(torch.from_numpy(theta).float(), expected.float(), rtol=2e-6, atol=0)
    assert m == pytest.approx(factor, rel=1e-12)


def test_llama3_keeps_fast_pairs_and_divides_slow_ones_by_s():
    """Wavelengths below L / high are unchanged, above L / low divided by s, and the blend is monotone."""
    s = RopeScaling("llama3", 8.0, 8192, 1.0, 4.0)
    theta = base_frequencies(128, 500000.0)
    scaled, _ = frequencies(128, 500000.0, s)
    wavelength = 2 * math.pi / theta
    fast, slow = wavelength < 8192 / 4.0, wavelength > 8192 / 1.0
    assert fast.any() and slow.any() and (~fast & ~slow).any()
    assert (scaled[fast] == theta[fast]).all()
    assert np.allclose(scaled[slow], theta[slow] / 8.0, rtol=1e-15, atol=0)
    ratio = theta / scaled  # 1 .. s, never decreasing with the pair index
    assert bool((ratio[1:] >= ratio[:-1] - 1e-12).all()) and ratio.min() == 1.0 and ratio.max() == 8.0


def test_yarn_turns_the_original_context_into_the_stretched_one():
    """A slow pair (divided by s) at position s L turns through the angle the unscaled pair had at L; m = 0.1 ln s + 1."""
    s, L = 4.0, 4096
    theta, m = frequencies(64, 10000.0, RopeScaling("yarn", s, L))
    plain = base_frequencies(64, 10000.0)
    assert float(theta[-1] * s * L) == pytest.approx(float(plain[-1] * L), rel=1e-12)
    assert float(theta[0]) == float(plain[0])
    assert m == pytest.approx(0.1 * math.log(s) + 1)
