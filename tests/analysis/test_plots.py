"""qkv.analysis.plots: every figure function writes a PNG that is not blank and returns the path it wrote (".png"
added to a bare name, an unknown extension refused in one line); metrics.csv is read as columns of floats, a
blank cell NaN, a bad one named with its row."""
import matplotlib.image
import numpy as np
import pytest

from qkv.analysis import plots
from qkv.config import TrainConfig
from qkv.errors import QkvError


def not_blank(path) -> bool:
    image = matplotlib.image.imread(str(path))
    return image.shape[0] > 100 and float(image[..., :3].std()) > 0.02


def test_every_figure_function_draws_something(tmp_path):
    rng = np.random.default_rng(0)
    written = [
        plots.sinusoidal_pe(tmp_path / "pe", d_model=16, positions=20),
        plots.rope_rotation(tmp_path / "rope.png", head_dim=8, positions=8),
        plots.attention_grid([rng.dirichlet(np.ones(5), size=(2, 5))], list("abcde"), tmp_path / "att.png"),
        plots.lr_schedules(TrainConfig(max_steps=200, warmup_steps=20), 64, tmp_path / "lr.png"),
        plots.grad_norms({"pre-LN": [0.3, 0.2, 0.1], "post-LN": [0.1, 0.1, 0.2]}, tmp_path / "g.png"),
    ]
    assert written[0] == tmp_path / "pe.png"  # a bare name gets matplotlib's default extension
    for path in written:
        assert path.is_file() and not_blank(path), path


def test_an_extension_without_a_writer_is_refused(tmp_path):
    with pytest.raises(QkvError, match=r"pe\.nope: "):
        plots.sinusoidal_pe(tmp_path / "pe.nope", d_model=8, positions=4)


def test_metrics_are_read_as_float_columns_with_nan_for_blanks(tmp_path):
    (tmp_path / "metrics.csv").write_text("step,loss,val_loss\n1,2.5,\n2,2.25,2.75\n")
    m = plots.read_metrics(tmp_path)
    np.testing.assert_array_equal(m["step"], [1.0, 2.0])
    np.testing.assert_array_equal(m["loss"], [2.5, 2.25])
    assert np.isnan(m["val_loss"][0]) and m["val_loss"][1] == 2.75
    plots.loss_curves([tmp_path], tmp_path / "loss.png")
    assert not_blank(tmp_path / "loss.png")


@pytest.mark.parametrize("text, message", [
    (None, "no metrics.csv"), ("step,loss\n", "has no rows yet"), ("step,loss\n1,low\n", "row 1: loss='low' is not a number"),
])
def test_missing_empty_and_malformed_metrics_are_named(tmp_path, text, message):
    if text is not None:
        (tmp_path / "metrics.csv").write_text(text)
    with pytest.raises(QkvError, match=message):
        plots.read_metrics(tmp_path)
