"""Continuous batching: a request's tokens do not depend on the requests around it.

Oracle: `qkv.generate.generate` on the request alone (no batch, no padding). The engine runs 16 requests of
different prompt lengths and lengths of output, which join the batch one by one while it runs and leave at
different steps, and must give every one of them exactly the tokens `generate` gives it alone, greedy and
sampled, for every kernel and positional encoding a decoder may use."""
import copy
import shutil
import threading

import pytest
import torch

import qkv
from qkv.generate import SamplingParams, generate
from torch._dynamo.utils import counters
from qkv.nn.kernels import KERNELS
from qkv.nn.positional import POSITIONALS
from qkv.serve.engine import Engine, Job
from qkv.serve.rows import gather_rows

V = 64
SAMPLED = ("temperature", "top_k", "top_p")


def model_for(**overrides):
    torch.manual_seed(0)
    fields = dict(vocab_size=V, d_model=32, n_heads=4, n_layers=2, d_ff=64, max_seq_len=64, init_std=0.3)
    return qkv.build_model(qkv.ModelConfig(**{**fields, **overrides})).eval()


def prompts(count=16, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, V, (int(torch.randint(1, 20, (1,), generator=g)),), generator=g).tolist()
            for _ in range(count)]


class Recorder:
    def __init__(self):
        self.tokens, self.reason, self.prompt, self.done = [], None, None, threading.Event()

    def job(self, prompt, max_new, **kwargs) -> Job:
        def on_token(choice):
            self.tokens.append(choice.token)
            return False

        def on_done(reason, error):
            assert error is None, error
            self.reason = reason
            self.done.set()

        return Job(prompt=list(prompt), max_new=max_new, on_token=on_token, on_done=on_done,
                   on_prompt=lambda entries: setattr(self, "prompt", entries), **kwargs)


def run_all(engine: Engine, jobs_of, count: int):
    """Submit `count` jobs from another thread while the engine runs (they join one by one); wait for all."""
    recorders = [Recorder() for _ in range(count)]

    def submit():
        for i, recorder in enumerate(recorders):
            engine.submit(jobs_of(i, recorder))

    thread = threading.Thread(target=submit)
    thread.start()
    thread.join()
    for recorder in recorders:
        assert recorder.done.wait(60)
    return recorders


def run_together(engine: Engine, jobs: list[Job], recorders: list[Recorder]) -> None:
    """Start the engine with every job queued at once (one request's choices), wait for all, stop it."""
    engine.start()
    try:
        engine.submit(*jobs)
        for recorder in recorders:
            assert recorder.done.wait(60)
    finally:
        engine.stop()


def alone(model, prompt, max_new, **kwargs):
    return generate(model, torch.tensor(prompt), max_new_tokens=max_new, **kwargs)[len(prompt):].tolist()


LENGTHS = [3 + 2 * i for i in range(16)]  # rows leave at different steps


def check_batched_equals_alone(model, sampled=False):
    engine = Engine(model, max_batch=16).start()
    try:
        texts = prompts()
        params = SamplingParams(temperature=0.9, top_k=2 ** 31, top_p=0.8)
        options = (lambda i: dict(processors=SAMPLED, params=params, seed=100 + i)) if sampled else (lambda i: {})
        got = run_all(engine, lambda i, r: r.job(texts[i], LENGTHS[i], **options(i)), len(texts))
    finally:
        engine.stop()
    for i, prompt in enumerate(texts):
        kwargs = dict(strategy="top-p", temperature=0.9, top_p=0.8, seed=100 + i) if sampled else {}
        assert got[i].tokens == alone(model, prompt, LENGTHS[i], **kwargs), f"request {i}"
        assert got[i].reason == "length"


@pytest.mark.parametrize("kernel", KERNELS.names())
def test_greedy_batched_equals_alone_for_every_kernel(kernel):
    spec = KERNELS.get(kernel)
    window = {"window": 6} if spec.windowed else {}
    check_batched_equals_alone(model_for(attention=kernel, **window))


@pytest.mark.parametrize("positional", POSITIONALS.names())
def test_greedy_batched_equals_alone_for_every_positional_encoding(positional):
    check_batched_equals_alone(model_for(positional=positional))


def test_a_bigram_models_rows_keep_their_own_last_token_when_batched():
    """The bigram table reads each row's previous token, which the batch's cache carries per row through
    gather_rows and keep; alone, generate's greedy tokens are the argmax of a full forward (no cache)."""
    model = model_for(positional="rope", bigram_vocab=61)
    with torch.no_grad():
        torch.nn.init.normal_(model.bigram_emb.weight)
        prompt = prompts()[0]
        ids = torch.tensor(prompt)
        for _ in range(6):
            ids = torch.cat([ids, model(ids[None])[0, -1].argmax()[None]])
    assert alone(model, prompt, 6) == ids[len(prompt):].tolist()
    check_batched_equals_alone(model)


# Gemma 3's layers with a 4-key window, in a ring of 20 slots (its embedding scale left out: the greedy text of
# this tiny model would repeat one token)
GEMMA = dict(positional="rope", norm="rmsnorm", ffn="glu", activation="gelu_tanh", bias=False, n_kv_heads=2,
             qk_norm=True, norm_placement="sandwich", layer_types=("sliding", "global"), sliding_window=4,
             rope_local_theta=100.0)


def test_sampled_batched_equals_alone_with_each_requests_own_seed():
    check_batched_equals_alone(model_for(positional="rope", n_kv_heads=2), sampled=True)


def test_stop_tokens_end_a_row_and_the_others_go_on():
    model = model_for()
    texts = prompts(8)
    free = [alone(model, p, 12) for p in texts]
    stops = [tokens[4] for tokens in free]  # each row stops at its own 5th token (or earlier: first occurrence)
    engine = Engine(model, max_batch=4).start()  # fewer rows than requests: the rest wait for a free row
    try:
        got = run_all(engine, lambda i, r: r.job(texts[i], 12, stop_tokens=(stops[i],)), len(texts))
    finally:
        engine.stop()
    for i in range(len(texts)):
        cut = free[i].index(stops[i]) + 1
        assert got[i].tokens == free[i][:cut] and got[i].reason == "stop"


def test_a_cancelled_row_leaves_at_once_and_the_rest_are_unchanged():
    model = model_for()
    texts = prompts(4)
    engine = Engine(model, max_batch=4)
    recorders = [Recorder() for _ in texts]
    jobs = [r.job(p, 40) for r, p in zip(recorders, texts)]
    long_job = jobs[0]
    original = long_job.on_token

    def cancel_after_three(choice):  # the client goes away after 3 tokens
        if len(recorders[0].tokens) == 2:
            long_job.cancel()
        return original(choice)

    long_job.on_token = cancel_after_three
    run_together(engine, jobs, recorders)
    assert recorders[0].reason == "cancelled" and len(recorders[0].tokens) <= 4
    for r, p in zip(recorders[1:], texts[1:]):
        assert r.tokens == alone(model, p, 40) and r.reason == "length"


def test_a_fault_in_one_rows_callback_ends_that_row_alone(capsys):
    model = model_for()
    texts = prompts(4)
    engine = Engine(model, max_batch=4)
    recorders = [Recorder() for _ in texts]
    jobs = [r.job(p, 20) for r, p in zip(recorders, texts)]
    errors = []

    def broken(choice):
        if len(errors) == 0 and jobs[1].generated == 3:
            errors.append(1)
            raise RuntimeError("boom")
        return False

    jobs[1].on_token = broken
    jobs[1].on_done = lambda reason, error: (errors.append(error), recorders[1].done.set())
    run_together(engine, jobs, recorders)
    assert errors[-1] == "internal error: RuntimeError: boom"
    assert "RuntimeError: boom" in capsys.readouterr().err  # the traceback is printed for the operator
    for i in (0, 2, 3):
        assert recorders[i].tokens == alone(model, texts[i], 20) and recorders[i].reason == "length"


def test_encoder_decoder_requests_equal_generate_alone():
    torch.manual_seed(0)
    cfg = qkv.ModelConfig(vocab_size=V, d_model=32, n_heads=4, n_layers=2, d_ff=64, max_seq_len=64, init_std=0.3,
                          arch="encoder-decoder")
    model = qkv.build_model(cfg).eval()
    texts = prompts(6)
    engine = Engine(model, max_batch=6).start()
    try:
        got = run_all(engine, lambda i, r: r.job(texts[i], LENGTHS[i], decoder_start=0), len(texts))
    finally:
        engine.stop()
    for i, src in enumerate(texts):
        expected = generate(model, torch.tensor(src), max_new_tokens=LENGTHS[i], decoder_start=0)[1:].tolist()
        assert got[i].tokens == expected


def test_logprobs_are_the_models_log_softmax_at_each_position():
    """Oracle: one forward over prompt + output without a cache; log_softmax of its logits."""
    model = model_for(positional="alibi")
    prompt = prompts(1)[0]
    recorder = Recorder()
    choices = []
    job = recorder.job(prompt, 10, top_logprobs=3, echo=True, processors=SAMPLED, seed=3,
                       params=SamplingParams(temperature=1.3, top_k=2 ** 31, top_p=1.0))
    job.on_token = lambda choice: choices.append(choice) or False
    run_together(Engine(model), [job], [recorder])
    ids = prompt + [c.token for c in choices]
    with torch.no_grad():
        logprobs = torch.log_softmax(model(torch.tensor([ids]))[0].double(), -1)  # (T, V)
    for t, choice in enumerate(choices):
        row = logprobs[len(prompt) - 1 + t]
        assert choice.logprob == pytest.approx(float(row[choice.token]), abs=1e-5)
        top = torch.topk(row, 3)
        assert [i for i, _ in choice.top] == top.indices.tolist()
        assert [lp for _, lp in choice.top] == pytest.approx(top.values.tolist(), abs=1e-5)
    echoed = recorder.prompt
    assert [c.token for c in echoed] == prompt[1:]
    for t, c in enumerate(echoed):
        assert c.logprob == pytest.approx(float(logprobs[t, prompt[t + 1]]), abs=1e-5)


def test_gather_rows_right_aligns_each_rows_columns_with_padding_before():
    model = model_for()
    a, b = model.new_cache(1, 10), model.new_cache(1, 10)
    with torch.no_grad():
        model(torch.tensor([[1, 2, 3, 4, 5]]), cache=a)
        model(torch.tensor([[7, 8]]), cache=b)
    out = gather_rows(model, [(a, 0, 5), (b, 0, 2)], room=3)
    assert out.length == 5 and out.max_len == 8 and out.padded
    assert out.padding[:, :5].tolist() == [[True] * 5, [False] * 3 + [True] * 2]
    assert out.positions[1, 3:5].tolist() == [0, 1] and out.next_position.tolist() == [5, 2]
    assert torch.equal(out.layers[1].k[1, :, 3:5], b.layers[1].k[0, :, :2])
    assert torch.equal(out.layers[0].v[0, :, :5], a.layers[0].v[0, :, :5])


@pytest.mark.parametrize("limit, dense, groups", [(2048, None, [16]), (40, None, [4, 3, 2, 2, 3, 2]),
                                                  (2048, 10, [3, 2, 1, 1, 1, 4, 4])])
def test_waiting_requests_are_prefilled_together_as_padded_rows(monkeypatch, limit, dense, groups):
    """Requests waiting together are read in one left-padded forward (rows x longest prompt within
    PREFILL_TOKENS; with an int8 model, prompts of one kind: shorter than quant.DENSE_PROMPT or not, whose
    products are taken two ways), echoed prompt log-probabilities included, and each gets what it gets alone."""
    monkeypatch.setattr("qkv.serve.engine.PREFILL_TOKENS", limit)
    model = model_for(positional="rope")
    if dense is not None:  # prompt lengths 8 1 4 | 10 12 | 4 | 13 | 3 | 17 19 10 13 | 4 9 1 4
        from qkv.generate.weights import prepare

        monkeypatch.setattr("qkv.nn.quant.DENSE_PROMPT", dense)
        prepare(model, dtype="fp32", quant="int8")
    engine = Engine(model, max_batch=16)
    sizes, prefill = [], engine.prefill
    engine.prefill = lambda jobs: (sizes.append(len(jobs)), prefill(jobs))
    texts = prompts()
    recorders = [Recorder() for _ in texts]
    jobs = [r.job(t, LENGTHS[i], echo=i % 3 == 0) for i, (r, t) in enumerate(zip(recorders, texts))]
    engine.submit(*jobs)  # all waiting before the loop starts
    run_together(engine, [], recorders)
    assert sizes == groups
    for i, prompt in enumerate(texts):
        assert recorders[i].tokens == alone(model, prompt, LENGTHS[i]), f"request {i}"
        if i % 3 == 0:  # echo: the prompt's own log-probabilities, as the model gives them alone
            want = torch.log_softmax(model(torch.tensor([prompt]))[0, :-1], -1)
            got = [entry.logprob for entry in recorders[i].prompt]
            torch.testing.assert_close(torch.tensor(got), want.gather(-1, torch.tensor(prompt[1:])[:, None])[:, 0],
                                       rtol=1e-5, atol=1e-5)


def test_a_full_queue_is_refused_and_nothing_is_lost():
    from qkv.serve.engine import Busy

    engine = Engine(model_for(), max_batch=1, max_queue=1)  # not started: nothing leaves the queue
    engine.submit(Recorder().job([1, 2], 3), Recorder().job([1, 2], 3))  # one row free + one queued
    with pytest.raises(Busy):
        engine.submit(Recorder().job([1], 3))
    assert len(engine.waiting) == 2


def test_a_job_being_prefilled_counts_as_running():
    """Between the queue and the batch (its prompt being read) a job is running: `load` never reads (0, 0)
    while one is in flight (/health and the server's disconnect wait read it)."""
    engine = Engine(model_for(), max_batch=2)
    entered, release, seen = threading.Event(), threading.Event(), []
    prefill = engine.prefill

    def held_prefill(jobs):
        entered.set()
        assert release.wait(30)
        prefill(jobs)

    engine.prefill = held_prefill
    recorder = Recorder()
    engine.start()
    try:
        engine.submit(recorder.job([1, 2, 3], 4))
        assert entered.wait(30)
        seen.append(engine.load)  # out of the queue, not yet in the batch
        release.set()
        assert recorder.done.wait(60)
    finally:
        engine.stop()
    assert seen == [(1, 0)] and engine.load == (0, 0) and len(recorder.tokens) == 4


@pytest.mark.parametrize("dtype, quant", [("fp32", "none"), ("fp32", "int8"), ("fp32", "int4")])
def test_greedy_batched_equals_alone_at_every_fp32_precision(dtype, quant):
    """A request's greedy tokens do not depend on the others with fp32 activations at every --quant (a LLaMA
    shape: GQA, fused projections, the quantized kernels and head). With bf16 activations they may: `qkv serve
    --dtype bf16` says so (tests/serve/test_server.py)."""
    from qkv.generate.weights import prepare

    model = model_for(positional="rope", norm="rmsnorm", ffn="glu", activation="silu", bias=False, n_kv_heads=2)
    prepare(model, dtype=dtype, quant=quant)
    check_batched_equals_alone(model)


def test_greedy_batched_equals_alone_with_a_half_cache():
    """`qkv serve --kv-dtype fp16`: each column is rounded alone as it is written, so a request's tokens still do
    not depend on the rows around it (the padded batch's caches hold fp16 too)."""
    from qkv.generate.weights import prepare, set_kv_dtype

    model = model_for(positional="rope", norm="rmsnorm", ffn="glu", activation="silu", bias=False, n_kv_heads=2)
    prepare(model, quant="int8")
    set_kv_dtype(model, "fp16")
    assert model.new_cache(2, 8).layers[0].k.dtype == torch.float16
    check_batched_equals_alone(model)


@pytest.mark.skipif(shutil.which("c++") is None and shutil.which("g++") is None,
                    reason="torch.compile on the CPU needs a C++ compiler; none on PATH")
def test_the_compiled_step_serves_every_row_as_the_general_step_does(monkeypatch, tmp_path):
    """`qkv serve --compile`: the engine's batch (rows joining and leaving, left-padded) decoded by the compiled
    step (qkv.generate.compiled) gives every request the tokens an uncompiled copy of the model gives it alone."""
    from qkv.generate import background, compiled
    from qkv.generate.weights import prepare

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    model = model_for(**GEMMA)  # (its sliding layer's keys in rings: the graphs warm_up traced are those served)
    prepare(model, quant="int4")
    general = copy.deepcopy(model)
    step = compiled.enable(model)
    background.warm_up(model, threads=1)  # one row, then batches: the two graphs, before serving
    calls, graphs = [], counters["stats"]["unique_graphs"]
    monkeypatch.setattr(compiled.CompiledStep, "__call__", counted(compiled.CompiledStep.__call__, calls))
    texts = prompts(8)
    engine = Engine(model, max_batch=8, threads=1).start()
    try:
        got = run_all(engine, lambda i, r: r.job(texts[i], LENGTHS[i]), len(texts))
    finally:
        engine.stop()
    assert step.failed is None and len(calls) == engine.steps >= LENGTHS[7] - 1  # every step compiled
    assert counters["stats"]["unique_graphs"] == graphs  # the graphs compiled before held (no recompile)
    for i, prompt in enumerate(texts):
        assert got[i].tokens == alone(general, prompt, LENGTHS[i]), f"request {i}"


def counted(function, calls: list):
    """`function`, recording each call."""
    def wrapper(*args, **kwargs):
        calls.append(1)
        return function(*args, **kwargs)
    return wrapper
