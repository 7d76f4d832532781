"""qkv.cli.convert (`qkv convert`): each direction's output line and --json, the usage rules (exit 2, one
line), and an existing --out left as it was. The converted weights are checked against transformers' own
forward; tests/hf/test_files.py checks the conversions themselves in depth."""
import json

import pytest
import torch

import qkv
from tests.formats.hf import TOL, V, cli, max_diff, save_hf
from tests.train import verse

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    from qkv.data.tokenizer import Tokenizer

    tokenizer = Tokenizer.train([verse()], vocab_size=V + 200)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=tokenizer.vocab_size, n_positions=32,
                                                                 n_embd=32, n_layer=1, n_head=4))
    path = save_hf(model, tmp_path_factory.mktemp("convert") / "hf")
    tokenizer.save(path / "tokenizer.json")
    return path, model.eval()


def test_from_hf_prints_json_and_the_run_computes_transformers_logits(hf_dir, tmp_path):
    path, model = hf_dir
    code, out, err = cli("convert", "--from-hf", str(path), "--out", str(tmp_path / "run"), "--json")
    assert code == 0, err
    assert json.loads(out) == {"from": str(path), "to": str(tmp_path / "run")}
    ids = torch.randint(0, model.config.vocab_size, (2, 12))
    with torch.no_grad():
        assert max_diff(qkv.load(tmp_path / "run").model(ids), model(input_ids=ids).logits) <= TOL


def test_to_hf_says_where_it_wrote_and_transformers_loads_it(hf_dir, tmp_path):
    path, model = hf_dir
    assert cli("convert", "--from-hf", str(path), "--out", str(tmp_path / "run"))[0] == 0
    code, out, err = cli("convert", str(tmp_path / "run"), "--to-hf", str(tmp_path / "back"))
    assert code == 0 and out == f"qkv: wrote {tmp_path / 'back'}\n", err
    ids = torch.randint(0, model.config.vocab_size, (1, 9))
    back = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "back").eval()
    with torch.no_grad():
        assert max_diff(back(input_ids=ids).logits, model(input_ids=ids).logits) <= TOL


@pytest.mark.parametrize("argv", [
    [], ["--from-hf", "X"], ["RUN"], ["--to-hf", "DIR"], ["RUN", "--to-hf", "DIR", "--out", "O"],
    ["--from-hf", "X", "--to-hf", "DIR"], ["RUN", "--from-hf", "X", "--out", "O"],
])
def test_usage_other_than_the_two_forms_exits_2_with_one_line(argv, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, out, err = cli("convert", *argv)
    assert code == 2 and out == "" and err.count("\n") == 1 and err.startswith("qkv: error: convert ")
    assert list(tmp_path.iterdir()) == []  # nothing written


def test_an_existing_out_dir_is_refused_and_kept(hf_dir, tmp_path):
    path, _ = hf_dir
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "notes.txt").write_text("mine")
    code, _, err = cli("convert", "--from-hf", str(path), "--out", str(tmp_path / "run"))
    assert code == 2 and "already exists and is not empty" in err
    assert [p.name for p in (tmp_path / "run").iterdir()] == ["notes.txt"]
    assert (tmp_path / "run" / "notes.txt").read_text() == "mine"
