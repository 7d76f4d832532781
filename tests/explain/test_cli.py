"""`qkv explain` from the command line: a qkv run and an imported Hugging Face GPT-2 (its page's logits equal
transformers' own), the size budget at the default job's shape, and bad input as one line with exit 2,
leaving an existing page untouched."""
import contextlib
import io
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers

import qkv.cli
from qkv.data.tokenizer import Tokenizer
from qkv.explain.page import BUDGET_BYTES, read_data
from tests.explain.test_trace import PROMPT, TEXT, tokenizer
from tests.serve import live

HAMLET = ("To be, or not to be, that is the question: Whether 'tis nobler in the mind to suffer The slings and "
          "arrows of outrageous fortune, Or to take arms against a sea of troubles And by opposing end them. To "
          "die, to sleep, No more; and by a sleep to say we end The heart-ache and the thousand natural shocks")


def cli(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = qkv.cli.main(list(argv))
    return code, out.getvalue(), err.getvalue()


def write_run(path: Path, tok: Tokenizer | None = None, **model) -> Path:
    """tests/serve/live.py's run dir, with learned positions unless given (the page's positions step)."""
    return live.write_run(path, tok, **{"positional": "learned", **model})


def test_a_run_gives_a_page_and_its_size(tmp_path):
    run = write_run(tmp_path / "run")
    code, out, err = cli("explain", str(run), "--text", PROMPT, "--target", " mat", "--out", str(tmp_path / "p.html"))
    assert code == 0, err
    assert out.startswith(f"{tmp_path / 'p.html'} (") and out.rstrip().endswith("MB)")
    meta = read_data((tmp_path / "p.html").read_text(encoding="utf-8"))["runs"][0]["meta"]
    assert meta["target"]["text"] == " mat" and meta["layers"][1]["label"] == "layer 1"


def test_an_imported_gpt2_page_has_transformers_logits(tmp_path):
    tok = tokenizer()
    config = transformers.GPT2Config(vocab_size=tok.vocab_size, n_positions=64, n_embd=32, n_layer=2, n_head=4)
    torch.manual_seed(0)
    oracle = transformers.GPT2LMHeadModel(config).eval()
    oracle.save_pretrained(tmp_path / "hf")
    tok.save(tmp_path / "hf" / "tokenizer.json")
    code, _, err = cli("explain", str(tmp_path / "hf"), "--text", PROMPT, "--out", str(tmp_path / "gpt2.html"))
    assert code == 0, err
    run = read_data((tmp_path / "gpt2.html").read_text(encoding="utf-8"))["runs"][0]
    with torch.no_grad():
        logits = oracle(torch.tensor([run["meta"]["ids"]])).logits[0, -1].double().numpy()
    page = run["arrays"]["output.logits"]
    assert np.abs(page - logits).max() <= 1e-5 * np.abs(logits).max()
    assert run["meta"]["model"]["activation"] == "gelu_tanh" and len(run["meta"]["layers"]) == 2


def test_the_default_jobs_shape_at_64_tokens_fits_the_budget(tmp_path):
    """4 layers x 64 tokens, 128 wide, 4 heads, FFN 512, 2,048-token vocabulary, rotary positions (the
    shakespeare preset's model): every array, nothing sampled."""
    tok = Tokenizer.train([TEXT * 20 + HAMLET * 5], 2048)
    run = write_run(tmp_path / "run", tok, vocab_size=2048, d_model=128, n_heads=4, n_layers=4, d_ff=512,
                    max_seq_len=256, init_std=0.02, positional="rope")
    text = HAMLET * 2
    code, _, err = cli("explain", str(run), "--text", text, "--out", str(tmp_path / "p.html"))
    assert code == 0, err
    html = (tmp_path / "p.html").read_text(encoding="utf-8")
    meta = read_data(html)["runs"][0]["meta"]
    assert len(meta["tokens"]) == 64 and meta["cut"] and len(meta["layers"]) == 4
    assert len(html.encode()) <= BUDGET_BYTES


@pytest.mark.parametrize("args, message", [
    (["{missing}", "--text", "x"], "no such run directory"),
    (["{run}", "--text", ""], "--text is empty"),
    (["{run}", "--text", "the", "--out", "{tmp}/page.txt"], "name it *.html"),
    (["{run}", "--text", "the", "--out", "{tmp}"], "is a directory"),
    (["{run}", "--text", "the", "--target", ""], "--target has no tokens"),
    (["{linear}", "--text", "the"], "model.attention=linear"),
    (["{bare}", "--text", "the"], "model.head=none"),
    (["{classifier}", "--text", "the", "--target", "romance"], "not one of the classifier's labels"),
    (["{run}", "--text", "the", "--compare", "{missing}"], "no such run directory"),
    (["{run}", "--text", "the dog sat", "--corrupt", "the"], "patching needs prompts of one length"),
    (["{run}", "--text", "the dog", "--corrupt", "the dog"], "no logit difference to give back"),
    (["{mlm}", "--text", "the dog", "--corrupt", "the cat"], "reads a decoder's next-token logits"),
])
def test_bad_input_is_one_line_exit_2_and_the_old_page_stays(tmp_path, args, message):
    dirs = {"run": write_run(tmp_path / "run"), "linear": write_run(tmp_path / "linear", attention="linear"),
            "bare": write_run(tmp_path / "bare", arch="encoder"), "mlm": write_run(tmp_path / "mlm", arch="encoder", head="mlm"),
            "classifier": write_run(tmp_path / "cls", arch="encoder", head="classifier", n_classes=2,
                                    labels=("comedy", "tragedy")),
            "missing": tmp_path / "nope", "tmp": tmp_path}
    old = tmp_path / "old.html"
    old.write_text("an earlier page")
    argv = [a.format(**dirs) for a in args]
    if "--out" not in argv:
        argv += ["--out", str(old)]
    code, out, err = cli("explain", *argv)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("qkv: error: ") and message in err, err
    assert old.read_text() == "an earlier page"
