"""Every command that takes a run takes a GGUF file directly (generate, chat, eval, plot, calc, explain, convert;
serve: tests/formats/gguf/test_smollm2.py), with the same results as the run dir converted from it."""
import json

import pytest

from qkv.formats.gguf import load
from tests.cli.test_main import cli
from tests.formats.gguf import TEXT, write_llama


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("cmd")
    path = write_llama(tmp / "m.gguf", seed=6)
    return path, tmp


def test_generate_and_chat_read_the_file_and_its_conversion_alike(capsys, model):
    path, tmp = model
    run = tmp / "run"
    assert cli(capsys, "convert", "--from-gguf", path, "--out", run)[0] == 0
    assert json.loads((run / "chat.json").read_text())["stop_ids"] == list(load(path).chat.stop_ids)
    outputs = []
    for source in (path, run):
        code, out, _ = cli(capsys, "generate", source, "--prompt", "To be", "--strategy", "greedy",
                           "--max-new-tokens", "8")
        assert code == 0
        outputs.append(out)
    assert outputs[0] == outputs[1] and outputs[0].startswith("To be")


def test_eval_plot_calc_and_explain_take_the_file(capsys, model, tmp_path):
    path, _ = model
    text = tmp_path / "held.txt"
    text.write_text("\n".join(TEXT[:8]))
    code, out, _ = cli(capsys, "eval", path, "--data", text, "--json")
    assert code == 0 and json.loads(out)["bits_per_char"] > 0
    code, out, _ = cli(capsys, "plot", "attention", path, "--text", "to be", "--out", tmp_path / "a.png")
    assert code == 0 and (tmp_path / "a.png").stat().st_size > 0
    code, out, _ = cli(capsys, "calc", path, "--json")
    counted = sum(p.numel() for p in load(path).model.parameters())
    assert code == 0 and json.loads(out)["params"]["total"] == counted
    code, out, _ = cli(capsys, "explain", path, "--text", "to be or", "--out", tmp_path / "e.html")
    assert code == 0 and (tmp_path / "e.html").stat().st_size > 0


def test_chat_reads_one_message_a_line_and_obeys_reset_and_quit(capsys, model, monkeypatch):
    """stdin not a terminal: each line one message, its reply on one line; /reset starts again (a reply equal to
    a fresh session's), /quit ends before the lines after it."""
    import io

    path, _ = model
    monkeypatch.setattr("sys.stdin", io.StringIO("to be\n/reset\nto be\n/quit\nnever read\n"))
    code, out, _ = cli(capsys, "chat", path, "--strategy", "greedy", "--max-new-tokens", "5", "--system", "Be brief.")
    replies = out.splitlines()
    assert code == 0 and len(replies) == 2 and replies[0] == replies[1] and replies[0].strip()
