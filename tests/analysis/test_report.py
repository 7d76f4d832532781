"""`qkv calc`'s and `qkv scaling`'s text (qkv.analysis.report): the units as the notes write them (175B x 2
bytes = 350 GB), and every figure of the --json dict in the text, formatted by those rules."""
import pytest

from qkv import presets
from qkv.analysis import calc
from qkv.analysis.report import calc_text, count, nbytes, scaling_text


@pytest.mark.parametrize("n,text", [(174604259328, "174.60 B"), (2.5e12, "2.50 T"), (1234, "1.23 K"),
                                    (999, "999"), (12_000_000, "12.00 M")])
def test_count_uses_the_short_scale(n, text):
    assert count(n) == text


@pytest.mark.parametrize("n,text", [(175e9 * 2, "350.00 GB"), (2.8e12, "2.80 TB"), (999, "999 B"), (1500, "1.50 KB")])
def test_nbytes_is_decimal(n, text):
    assert nbytes(n) == text


def test_calc_text_carries_every_figure_of_the_dict():
    cfg = presets.get("tiny").override(["parallel.pp=2"])
    result = calc.calculate(cfg, tokens=1e9, step_time=0.5, peak_flops=1e12)
    text = calc_text(result)
    for name, value in result["params"].items():
        assert f"{value:,}" in text, name
    for part, value in result["memory"]["bytes"].items():
        assert nbytes(value) in text, part
    assert f"pp 2 (1f1b, {result['setup']['microbatches']} micro-batches)" in text
    assert "most loaded rank" in text
    assert count(result["flops"]["train_per_token"]) in text
    assert f"{100 * result['mfu']['mfu']:.1f}%" in text
    assert f"{result['compute']['six_nd']:.3g}" in text


def test_scaling_text_lists_each_fit_and_the_optimum():
    result = {"x": "N", "fits": [{"runs": "3 runs", "a": 406.4, "b": 0.34, "c": 1.69, "points": 3, "rmse": 0.01}],
              "chinchilla": {"fit": "hoffmann", "flops": 1e21, "params": 2.5e9, "tokens": 6.7e10,
                             "tokens_per_param": 26.8, "loss": 2.33},
              "chinchilla_other_fits": []}
    text = scaling_text(result)
    assert "L(N) = 406.4 / N^0.3400 + 1.6900 (3 points" in text
    assert "N_opt = 2.50 B parameters, D_opt = 67.00 B tokens (26.8 tokens/param), loss 2.330" in text
