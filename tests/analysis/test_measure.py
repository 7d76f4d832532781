"""The measurements the calculators are checked against (qkv.analysis.measure), on cases whose answer is
known in closed form: tensors of known sizes allocated and freed, one matmul's FLOPs, one op's saved tensors."""
import torch

from qkv.analysis.measure import LiveBytes, count_flops, optimizer_tensors, peak_step_bytes, saved_for_backward_bytes


def test_live_bytes_peak_is_the_most_alive_at_once():
    """4 kB then 8 kB alive (12 kB), 4 kB freed, 2 kB more: the peak is 12 kB and 10 kB remain."""
    with LiveBytes() as mode:
        a = torch.empty(1000)
        b = torch.empty(2000)
        del a
        c = torch.empty(500)
    assert mode.peak == 12_000 and mode.current == 10_000
    assert b.numel() + c.numel() == 2500


def test_existing_storages_are_the_baseline_counted_once():
    """A weight and a view of it are one storage; writing into it in place allocates nothing."""
    weight = torch.zeros(256)
    with LiveBytes([weight, weight[:10]]) as mode:
        weight.add_(1.0)
    assert mode.baseline == 1024 and mode.peak == 0 and mode.peak_total == 1024


def test_peak_step_counts_gradients_and_activations():
    """A linear layer's step: baseline = W, b and Adam's moments (and steps); the peak adds at least the
    gradients (same size as W and b) and the layer's output."""
    layer = torch.nn.Linear(64, 32)
    optimizer = torch.optim.Adam(layer.parameters())
    x = torch.randn(16, 64)

    def step():
        layer(x).square().sum().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    result = peak_step_bytes(layer, optimizer, step)
    weights = 4 * (64 * 32 + 32)
    assert result["baseline"] == 3 * weights + sum(t.nbytes for t in optimizer_tensors(optimizer) if t.dim() == 0)
    assert result["peak"] - result["baseline"] >= weights + 4 * 16 * 32


def test_count_flops_of_a_matmul_is_2mkn():
    a, b = torch.randn(8, 16), torch.randn(16, 4)
    total, per_op = count_flops(lambda: a @ b)
    assert total == 2 * 8 * 16 * 4 and sum(per_op.values()) == total


def test_saved_for_backward_of_a_product_is_both_inputs():
    """d(xy)/dx = y and d(xy)/dy = x: autograd keeps both factors, 2 x 4 x 100 bytes."""
    x, y = torch.randn(100, requires_grad=True), torch.randn(100, requires_grad=True)
    assert saved_for_backward_bytes(lambda: x * y) == 800
