"""The compiled decoding step from the command line (`qkv generate --compile`, `qkv chat --compile`): the same
text as without it, both of chat's graphs compiled before its first turn, and inductor's cache under the user's
home."""
import io
import os
import subprocess
import sys

import pytest
from torch._dynamo.utils import counters

from qkv.generate import compiled
from tests.analysis import run_cli
from tests.cli.test_main import cli
from tests.formats.gguf import write_llama
from tests.generate.test_compiled import NEEDS_CXX
from tests.train import setup_env, trained_run

pytestmark = [NEEDS_CXX, pytest.mark.usefixtures("own_inductor_cache")]  # (tests/generate/conftest.py)


def test_cli_compile_gives_the_same_text_and_refuses_steering(monkeypatch, tmp_path_factory):
    setup_env(monkeypatch, tmp_path_factory)
    run = trained_run(tmp_path_factory)[0]
    args = ("generate", run, "--prompt", "the", "--strategy", "greedy", "--max-new-tokens", "12")
    rc, plain, err = run_cli(*args)
    assert rc == 0, err
    rc, fast, err = run_cli(*args, "--compile")
    assert rc == 0, err
    assert fast == plain and "qkv: --compile: the first token step compiles" in err
    rc, out, err = run_cli(*args, "--compile", "--steer", f"{tmp_path_factory.mktemp('v')}/v.safetensors@0:1")
    assert rc == 2 and err.strip() == ("qkv: error: --compile does not apply with --steer: the steering hooks must "
                                       "see their layers run")


def test_chat_compiles_both_graphs_before_its_first_turn_and_replies_the_same(tmp_path, capsys, monkeypatch):
    """`qkv chat --compile`: the token step and a short prompt's prefill compile before the first turn (two graphs,
    none after; that a later turn's short prompt into the filled cache takes the same graph:
    tests/generate/test_compiled_prompt.py), and the replies are those without --compile."""
    path = write_llama(tmp_path / "m.gguf", seed=4)  # a LLaMA-shaped GGUF file with a chat template
    args = ("chat", path, "--strategy", "greedy", "--max-new-tokens", "6")
    turns = "to be or not\nthe question\nto be\n"
    monkeypatch.setattr("sys.stdin", io.StringIO(turns))
    code, plain, _ = cli(capsys, *args)
    assert code == 0 and len(plain.splitlines()) == 3
    prompts, prompt = [], compiled.CompiledStep.prompt
    monkeypatch.setattr(compiled.CompiledStep, "prompt", lambda self, ids, cache: prompts.append(
        (ids.shape[1], cache.length)) or prompt(self, ids, cache))
    monkeypatch.setattr("sys.stdin", io.StringIO(turns))
    before = counters["stats"]["unique_graphs"]
    code, fast, err = cli(capsys, *args, "--compile")
    assert code == 0 and fast == plain, err
    assert "compiling the token step and a short prompt's prefill before the first turn" in err and "ready (" in err
    assert counters["stats"]["unique_graphs"] == before + 2
    assert prompts[0] == (2, 0)  # the warm-up's (this test tokenizer's turns are longer than PROMPT_ROWS)


def test_inductors_cache_goes_under_home_even_after_torch_named_its_own(tmp_path):
    """Importing TorchDynamo (as loading a model may, before any step is compiled) makes torch write its own
    default (/tmp/torchinductor_<user>) into TORCHINDUCTOR_CACHE_DIR; the step's cache still goes to
    ~/.cache/qkv/inductor, and a directory the user chose stays. A fresh process: the import order is the point."""
    code = ("import os, torch, torch._dynamo\n"
            "from qkv.generate import compiled\n"
            "torch_set = os.environ.get('TORCHINDUCTOR_CACHE_DIR')\n"
            "compiled.inductor_cache()\n"
            "print(torch_set, os.environ['TORCHINDUCTOR_CACHE_DIR'])\n")
    env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"}
    env["HOME"] = str(tmp_path)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    torch_set, ours = out.stdout.split()
    assert torch_set == compiled.torch_default_cache()  # torch did name its own before qkv asked
    assert ours == str(tmp_path / ".cache" / "qkv" / "inductor")
    env["TORCHINDUCTOR_CACHE_DIR"] = str(tmp_path / "mine")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == [str(tmp_path / "mine")] * 2
