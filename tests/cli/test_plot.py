"""qkv.cli.plot (`qkv plot FIGURE`): each figure's handler writes a PNG that is not blank and prints
its path, the attention figure reads a trained run (with its page), and bad input is one line, exit 2."""
import pytest

from qkv.cli.plot import token_strings
from tests.analysis import run_cli
from tests.analysis.test_plots import not_blank
from tests.train import setup_env, trained_run


def test_plot_commands(tmp_path):
    for figure, extra in (("pe", ["--d-model", "32"]), ("rope", []), ("lr", ["--preset", "tiny"]),
                          ("gradnorm", ["--layers", "3"])):
        rc, out, err = run_cli("plot", figure, *extra, "--out", tmp_path / f"{figure}.png")
        assert rc == 0, err
        assert out.strip() == str(tmp_path / f"{figure}.png") and not_blank(out.strip())
    rc, _, err = run_cli("plot", "lr", "--schedule", "nope", "--out", tmp_path / "x.png")
    assert rc == 2 and "choose from" in err and err.count("\n") == 1


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        setup_env(mp, tmp_path_factory)
        return trained_run(tmp_path_factory)[0]


def test_loss_and_attention_from_a_run(run, tmp_path):
    rc, out, err = run_cli("plot", "loss", run, "--out", tmp_path / "loss.png")
    assert rc == 0 and not_blank(tmp_path / "loss.png"), err
    rc, out, err = run_cli("plot", "attention", run, "--text", "The moon doth sing", "--out", tmp_path / "a.png",
                           "--html", tmp_path / "a.html")
    assert rc == 0, err
    assert out.split() == [str(tmp_path / "a.png"), str(tmp_path / "a.html")]
    assert not_blank(tmp_path / "a.png")
    rc, _, err = run_cli("plot", "attention", tmp_path / "missing", "--text", "x", "--out", tmp_path / "b.png")
    assert rc == 2 and err.startswith("qkv: error:")


def test_attention_refuses_empty_and_too_long_text(run, tmp_path):
    rc, _, err = run_cli("plot", "attention", run, "--text", "", "--out", tmp_path / "a.png")
    assert rc == 2 and "--text must not be empty" in err and err.count("\n") == 1
    rc, _, err = run_cli("plot", "attention", run, "--text", "word " * 400, "--out", tmp_path / "a.png")
    assert rc == 2 and "the model reads at most" in err and not (tmp_path / "a.png").exists()


def test_token_strings_decode_each_id_alone(run):
    import qkv

    tokenizer = qkv.load(run).tokenizer
    ids = tokenizer.encode("The moon doth sing")
    pieces = token_strings(tokenizer, ids)
    assert len(pieces) == len(ids) and "".join(pieces) == tokenizer.decode(ids)
