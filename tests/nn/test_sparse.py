"""The sparse kernels skip what they mask (qkv.nn.sparse, note 000 §15.1), measured with torch's FLOP counter
and saved_tensors_hooks: at a fixed window local's and random's work and saved bytes grow linearly in n (x2
per doubling, where naive's grow x4); dilated's scores are 1/d of naive's (each query reads every d-th key)
and its saved bytes linear. The patterns against their definitions (|i - j| <= w, i - j = 0 mod d)."""
import pytest
import torch

from qkv.analysis.measure import count_flops, saved_for_backward_bytes
from qkv.nn.kernels import KERNELS
from qkv.nn.sparse import dilated_pattern, local_pattern


def inputs(n: int):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(1, 2, n, 16, generator=g, requires_grad=True) for _ in range(3)]


def cost(name: str, n: int, window: int) -> tuple[int, int]:
    """(forward + backward FLOPs, bytes saved for the backward) of one causal call at length n."""
    kernel = KERNELS.get(name).fn
    extra = {"window": window} if KERNELS.get(name).windowed else {}

    def call():
        q, k, v = inputs(n)
        return kernel(q, k, v, mask=None, causal=True, bias=None, scale=0.25, **extra)

    flops, _ = count_flops(lambda: call().sum().backward())
    return flops, saved_for_backward_bytes(call)


@pytest.mark.parametrize("name,window", [("local", 32), ("random", 16)])
def test_work_and_saved_bytes_grow_linearly_at_a_fixed_window(name, window):
    (f1, s1), (f2, s2) = cost(name, 512, window), cost(name, 1024, window)
    assert f2 / f1 == pytest.approx(2, rel=0.15) and s2 / s1 == pytest.approx(2, rel=0.15)
    (g1, t1), (g2, t2) = cost("naive", 512, 0), cost("naive", 1024, 0)
    assert g2 / g1 > 3.5 and t2 / t1 > 3.5  # the dense kernel's scores: x4


def test_dilated_computes_one_key_in_d():
    """Measured at d = 4: 0.29 and 0.22 of naive's FLOPs at n = 512 and 1024 (the scores 1/4, plus the
    projections of the classes); its saved bytes x2 per doubling."""
    (f1, s1), (f2, s2) = cost("dilated", 512, 4), cost("dilated", 1024, 4)
    n1, n2 = cost("naive", 512, 0)[0], cost("naive", 1024, 0)[0]
    assert 0.2 < f1 / n1 < 0.35 and 0.15 < f2 / n2 < 0.3 and s2 / s1 == pytest.approx(2, rel=0.15)


def test_patterns_are_their_definitions():
    cols = torch.arange(12)
    i, j = cols[:, None], cols[None, :]
    assert torch.equal(local_pattern(cols, cols, window=3), (i - j).abs() <= 3)
    assert torch.equal(dilated_pattern(cols, cols, window=4), (i - j) % 4 == 0)
