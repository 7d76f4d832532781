"""The decoding step compiled in the background (qkv.generate.background.Background), as generate, chat and serve
compile it by default: the model decodes eagerly until the step is ready, then the compiled step takes over,
and the logits across the switch are the general step's (to fp32's rounding, as tests/generate/test_compiled.py
holds the compiled step). Inductor's cache goes to a temporary directory, not the user's."""
import io
import os
import subprocess
import sys

import pytest
import torch
from torch._dynamo.utils import counters

from qkv.generate import background, compiled
from qkv.nn.decoding_linear import DecodingLinear, decoding_linears
from tests.cli.test_main import cli
from tests.formats.gguf import write_llama
from tests.generate.test_compiled import LLAMA, NEEDS_CXX, PROMPT, tiny

pytestmark = [NEEDS_CXX, pytest.mark.usefixtures("own_inductor_cache")]  # (tests/generate/conftest.py)


def test_the_step_compiled_in_the_background_takes_over_with_the_general_steps_logits():
    """Eager tokens while the compiler works, the compiled step's once it is done (switched by usable() itself,
    announced in one line), each token's logits those of a twin model decoded by the general step throughout;
    the graphs traced on a copy of the modules that holds the model's own tensors (nothing copied) and on the
    caches chat decodes with: no graph traced again after the switch (a sliding model's rings: the server's
    compiled test, tests/serve/test_engine.py)."""
    model, reference = tiny(**LLAMA), tiny(**LLAMA)  # (the same seed: the same weights)
    lines: list[str] = []
    step = background.enable_in_background(model, threads=1, rows=(1,), prompt=False, announce=lines.append)
    owned = {id(tensor) for tensor in background.tensors_held(model)}
    assert step.model is not model and all(id(tensor) in owned for tensor in background.tensors_held(step.model))
    assert any(isinstance(layer, DecodingLinear) for layer in step.model.modules())  # (the twin's, for good)
    assert not any(isinstance(layer, DecodingLinear) for layer in model.modules())  # (the owner's as they were)
    paths = []
    with torch.inference_mode(), decoding_linears(model):
        cache, general = model.new_cache(1, 40, rolling=True), reference.new_cache(1, 40, rolling=True)
        got = compiled.prompt_logits(model, torch.tensor([PROMPT]), cache)
        want = reference(torch.tensor([PROMPT]), cache=general)[:, -1]
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        token = want.argmax(-1)
        for i in range(12):
            if i == 4:  # (4 eager tokens take milliseconds; the compiler seconds)
                assert step.background.wait(600) and step.failed is None
                graphs = counters["stats"]["unique_graphs"]
            paths.append(step.usable(cache))
            got = compiled.next_logits(model, token, cache)
            want = reference(token[:, None], cache=general)[:, -1]
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)  # the same math, fused: fp32 rounding
            token = want.argmax(-1)
    assert paths == [False] * 4 + [True] * 8 and counters["stats"]["unique_graphs"] == graphs
    assert len(lines) == 1 and lines[0].startswith("qkv: the compiled decoding step takes over (compiled in the "
                                                   "background in ")
    for a, b in zip(general.layers, cache.layers):
        torch.testing.assert_close(b.k[:, :, :cache.length], a.k[:, :, :general.length], rtol=1e-5, atol=1e-5)


def test_the_twin_of_a_quantized_model_holds_its_kernel_operands():
    """The graphs of a quantized model are traced on a twin holding the very codes, scales and kernel operands
    (made before the copy) of the model: a background compile costs no second copy of the weights."""
    from qkv.generate.watch import kernel_operands

    for quant in ("int4", "int8"):
        model = tiny(quant, **LLAMA)
        operands = kernel_operands(model, make=True)
        double = background.twin(model)
        owned = {id(tensor) for tensor in background.tensors_held(model)}
        assert operands and all(id(tensor) in owned for tensor in operands)
        assert all(id(tensor) in owned for tensor in background.tensors_held(double))
        assert all(id(tensor) in owned for tensor in kernel_operands(double))
        assert len(list(background.tensors_held(double))) == len(list(background.tensors_held(model)))


def test_chat_compiles_in_the_background_by_default_and_switches_between_turns(tmp_path, capsys, monkeypatch):
    """`qkv chat` with no flag: the step compiles in the background (here waited for, so that it is ready at
    once), takes over before a turn (never inside a streamed reply: not by itself), says so in one line, and
    the replies are those of --no-compile; QKV_COMPILE=0 and --no-compile compile nothing."""
    path = write_llama(tmp_path / "m.gguf", seed=4)
    args = ("chat", path, "--strategy", "greedy", "--max-new-tokens", "6")
    turns = "to be or not\nthe question\n"
    monkeypatch.setattr("sys.stdin", io.StringIO(turns))
    code, plain, err = cli(capsys, *args, "--no-compile")
    assert code == 0 and len(plain.splitlines()) == 2, err

    started, real = [], background.enable_in_background

    def waited(model, **options):
        started.append(options)
        step = real(model, **options, prompt=False)  # (the token step's graph alone: half the compiling)
        assert not step.usable(model.new_cache(1, 8))  # (eager until it is ready)
        assert step.background.wait(600)
        assert not step.usable(model.new_cache(1, 8))  # (a chat switches between turns, not by itself)
        return step

    monkeypatch.setattr(background, "enable_in_background", waited)
    monkeypatch.delenv("QKV_COMPILE")
    monkeypatch.setattr("sys.stdin", io.StringIO(turns))
    code, fast, err = cli(capsys, *args)
    assert code == 0 and fast == plain, err
    assert started == [dict(announce=started[0]["announce"], automatic=False)]
    assert err.count("qkv: the compiled decoding step takes over") == 1
    for off in (("--no-compile",), ()):
        if not off:
            monkeypatch.setenv("QKV_COMPILE", "0")
        monkeypatch.setattr("sys.stdin", io.StringIO(turns))
        code, out, err = cli(capsys, *args, *off)
        assert code == 0 and out == plain and len(started) == 1, err  # (nothing more started)


def test_generate_leaves_a_background_compile_behind_with_its_whole_output(tmp_path):
    """`qkv generate` whose text is done before the step is compiled: the process exits (without waiting for the
    compiler's workers) with every line of its output written, the text --no-compile gives."""
    path = write_llama(tmp_path / "m.gguf", seed=4)
    env = {key: value for key, value in os.environ.items() if key != "QKV_COMPILE"}
    args = [sys.executable, "-m", "qkv", "generate", str(path), "--prompt", "to be", "--strategy", "greedy",
            "--max-new-tokens", "8"]
    plain = subprocess.run(args + ["--no-compile"], capture_output=True, text=True, env=env, timeout=300)
    assert plain.returncode == 0, plain.stderr
    background = subprocess.run(args, capture_output=True, text=True, env=env, timeout=300)
    assert background.returncode == 0 and background.stdout == plain.stdout, background.stderr
    assert "Traceback" not in background.stderr


def test_serve_compiles_batches_in_the_background_by_default(tmp_path, monkeypatch):
    """prepare(compile="background") (`qkv serve` with no flag) starts the compiler for one row and batches, on
    the engine's threads, announcing through the server's log; "off" starts nothing; anything else is refused."""
    from qkv.serve.server import prepare
    from tests.serve.live import write_run

    path = write_run(tmp_path / "run")
    calls = []
    monkeypatch.setattr(background, "enable_in_background", lambda model, *a, **k: calls.append((a, k)))
    log = []
    served = prepare(str(path), compile="background", log=log.append, threads=1)
    assert calls == [((1,), dict(rows=(1, 2), prompt=False, announce=log.append))]
    assert served.engine.threads == 1
    prepare(str(path), compile="off", log=log.append)
    assert len(calls) == 1
    with pytest.raises(ValueError, match="compile='yes'"):
        prepare(str(path), compile="yes", log=log.append)


def test_one_threads_summing_is_not_anothers(monkeypatch):
    """summing(True) holds on the thread that traces only: torch.compiler.is_compiling() is true on every thread
    while one traces, and an eager product beside a background compile must keep its own form (the sum form
    eagerly builds the whole (out, in) product: SmolLM2's 24 eager tokens took 5 s instead of 0.5)."""
    import threading

    from qkv.nn import decoding_linear

    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)  # (as while another thread traces)
    row, seen, inside, done = torch.ones(1, 8), {}, threading.Event(), threading.Event()

    def tracing():
        with torch.inference_mode(), decoding_linear.summing(True):
            seen["tracer"] = decoding_linear.summed_rows(row)
            inside.set()
            done.wait(10)

    thread = threading.Thread(target=tracing)
    thread.start()
    assert inside.wait(10)
    with torch.inference_mode():
        seen["eager"] = decoding_linear.summed_rows(row)
    done.set()
    thread.join(10)
    assert seen == {"tracer": True, "eager": False}
