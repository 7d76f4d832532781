"""`qkv serve` (qkv.serve.server, with its engine behind the app) against the real `openai` client on 127.0.0.1.

Oracles: `qkv generate`'s text (qkv.generate.text.generate_text) for the same prompt and settings, alone;
`qkv eval`'s per-token log-likelihoods (qkv.evaluate.tokens.score_tokens) for echo; one uncached forward for
logprobs; transformers' generate for a served HF dir. Capacity (429), disconnects, SIGTERM and bad options
are the server's; tests/serve/test_app.py has the routes, errors and embeddings."""
import json
import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import torch

import qkv
from qkv.evaluate.scoring import text_tokens
from qkv.evaluate.tokens import score_tokens
from qkv.formats.chat import DEFAULT_STOP
from qkv.generate.text import generate_text
from tests.serve.live import Live, write_run

PROMPTS = ["the cat", "the dog ran", "where", "on the mat, said", "the", "said the dog.\n", "cat? on", "mat"]


def expected(run, prompt, max_tokens, strategy="greedy", temperature=1.0, top_p=1.0, seed=0, stop=()):
    """The continuation `qkv generate` prints for these settings."""
    text = generate_text(run, prompt, max_new_tokens=max_tokens, strategy=strategy, temperature=temperature,
                         top_k=50, top_p=top_p, num_beams=1, seed=seed, stop_strings=stop)
    return text[len(prompt):]


def test_greedy_completion_equals_qkv_generate(live, run):
    result = live.client().completions.create(model="tiny", prompt="the cat", max_tokens=20, temperature=0)
    assert result.choices[0].text == expected(run, "the cat", 20)
    ids = [run.tokenizer.eos_id] + run.tokenizer.encode("the cat")
    assert result.usage.prompt_tokens == len(ids)
    assert result.usage.total_tokens == result.usage.prompt_tokens + result.usage.completion_tokens
    assert result.object == "text_completion" and result.model == "tiny"


def test_sampled_completion_with_a_seed_equals_qkv_generate(live, run):
    client = live.client()
    result = client.completions.create(model="tiny", prompt="the dog", max_tokens=24, temperature=0.8, top_p=0.9,
                                       seed=7, n=3)
    for j, choice in enumerate(result.choices):  # choice j draws with seed + j
        assert choice.index == j
        assert choice.text == expected(run, "the dog", 24, "top-p", 0.8, 0.9, seed=7 + j)
    assert len({c.text for c in result.choices}) > 1


def test_sixteen_concurrent_clients_each_get_what_they_get_alone(live, run):
    client = live.client()
    jobs = [(PROMPTS[i % len(PROMPTS)], 8 + 3 * i) for i in range(16)]
    steps_before = live.served.engine.steps

    def ask(job):
        prompt, n = job
        return client.completions.create(model="tiny", prompt=prompt, max_tokens=n, temperature=0).choices[0].text

    with ThreadPoolExecutor(16) as pool:
        got = list(pool.map(ask, jobs))
    for (prompt, n), text in zip(jobs, got):
        assert text == expected(run, prompt, n)
    # batched: far fewer decoding steps than the tokens made (each step serves every running request)
    tokens = sum(n for _, n in jobs)
    assert live.served.engine.steps - steps_before < tokens / 2


def sse(url, body, headers=None):
    """The data lines of a server-sent event stream."""
    with httpx.stream("POST", url, json=body, headers=headers, timeout=60) as response:
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
        return [line[6:] for line in response.iter_lines() if line.startswith("data: ")]


def test_streamed_completion_and_chat_equal_the_whole_reply(live, run):
    body = {"model": "tiny", "prompt": "the cat", "max_tokens": 30, "temperature": 0}
    data = sse(live.url + "/v1/completions", {**body, "stream": True, "stream_options": {"include_usage": True}})
    assert data[-1] == "[DONE]"
    chunks = [json.loads(d) for d in data[:-1]]
    text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    assert text == expected(run, "the cat", 30)
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] > 0
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] in ("stop", "length")

    client = live.client()
    messages = [{"role": "user", "content": "where is the cat?"}]
    whole = client.chat.completions.create(model="tiny", messages=messages, max_tokens=25, temperature=0)
    parts = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=25, temperature=0,
                                                stream=True))
    assert parts[0].choices[0].delta.role == "assistant"
    assert "".join(p.choices[0].delta.content or "" for p in parts) == whole.choices[0].message.content
    assert parts[-1].choices[0].finish_reason == whole.choices[0].finish_reason


def test_chat_renders_the_default_template_and_equals_generate_on_it(live, run):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "the cat"}]
    result = live.client().chat.completions.create(model="tiny", messages=messages, max_tokens=20, temperature=0)
    rendered = "System: Be brief.\nUser: the cat\nAssistant:"
    assert result.usage.prompt_tokens == 1 + len(run.tokenizer.encode(rendered))
    assert result.choices[0].message.content == expected(run, rendered, 20, stop=DEFAULT_STOP)
    assert result.choices[0].message.role == "assistant" and result.object == "chat.completion"


def test_echo_logprobs_are_qkv_evals_log_likelihoods(live, run):
    """lm-eval's loglikelihood request: echo the prompt, generate nothing, read each token's logprob."""
    text = "where is the cat? on the mat."
    result = live.client().completions.create(model="tiny", prompt=text, max_tokens=0, echo=True, logprobs=1)
    choice = result.choices[0]
    assert choice.text == text
    logprobs = choice.logprobs.token_logprobs
    assert len(logprobs) == len(run.tokenizer.encode(text))
    scored = score_tokens(run.model, text_tokens(run, text), characters=len(text), seq_len=64, stride=32,
                          device="cpu")
    assert -sum(logprobs) == pytest.approx(scored["loss"] * scored["tokens"], rel=1e-5)
    assert "".join(choice.logprobs.tokens) == text
    assert choice.logprobs.text_offset[0] == 0 and choice.logprobs.text_offset[-1] < len(text)


def test_logprobs_of_new_tokens_and_their_alternatives(live, run):
    result = live.client().completions.create(model="tiny", prompt="the dog", max_tokens=8, temperature=0,
                                              logprobs=3, echo=True)
    lp = result.choices[0].logprobs
    n_prompt = len(run.tokenizer.encode("the dog"))
    prompt = [run.tokenizer.eos_id] + run.tokenizer.encode("the dog")
    ids = qkv.generate(run.model, torch.tensor(prompt), max_new_tokens=8).tolist()  # greedy, as asked
    ids = ids[:len(prompt) + result.usage.completion_tokens]
    assert len(lp.token_logprobs) == len(ids) - 1
    with torch.no_grad():
        oracle = torch.log_softmax(run.model(torch.tensor([ids]))[0].double(), -1)
    for t in range(len(lp.token_logprobs)):
        assert lp.token_logprobs[t] == pytest.approx(float(oracle[t, ids[t + 1]]), abs=1e-5)
        best = max(lp.top_logprobs[t].values())
        assert best == pytest.approx(float(oracle[t].max()), abs=1e-5)
        if t >= n_prompt:  # greedy: each new token is the most likely one
            assert lp.token_logprobs[t] == pytest.approx(best, abs=1e-6)
    assert lp.text_offset == sorted(lp.text_offset)


def test_a_stop_string_cuts_the_text_before_it(live, run):
    free = expected(run, "the cat", 40)
    stop = free[6:9]
    assert stop and stop in free
    result = live.client().completions.create(model="tiny", prompt="the cat", max_tokens=40, temperature=0,
                                              stop=[stop, "never there"])
    assert result.choices[0].text == free[:free.index(stop)]
    assert result.choices[0].finish_reason == "stop"


def slow_steps(engine, seconds):
    step = engine.step

    def slow():
        time.sleep(seconds)
        step()

    engine.step = slow


def test_past_capacity_a_request_gets_429(run_dir):
    with Live(run_dir, max_batch=1, max_queue=0) as server:
        slow_steps(server.served.engine, 0.02)
        first = threading.Thread(target=lambda: server.client().completions.create(
            model="tiny", prompt="the", max_tokens=40))
        first.start()
        while server.served.engine.load[0] == 0:
            time.sleep(0.005)
        with pytest.raises(openai.RateLimitError) as exc:
            server.client().completions.create(model="tiny", prompt="the", max_tokens=2)
        assert exc.value.status_code == 429
        first.join()
        assert server.client().completions.create(model="tiny", prompt="the", max_tokens=2).usage.completion_tokens


def test_a_client_that_disconnects_mid_stream_frees_its_row_at_once(run_dir):
    with Live(run_dir, max_batch=2) as server:
        engine = server.served.engine
        slow_steps(engine, 0.02)
        submitted = []
        submit = engine.submit
        engine.submit = lambda *jobs: submitted.extend(jobs) or submit(*jobs)
        body = {"model": "tiny", "prompt": "the", "max_tokens": 60, "stream": True}
        with httpx.stream("POST", server.url + "/v1/completions", json=body) as response:
            lines = response.iter_lines()
            next(line for line in lines if line.startswith("data: "))
        deadline = time.monotonic() + 5
        while engine.load != (0, 0):
            assert time.monotonic() < deadline
            time.sleep(0.01)
        job = submitted[0]
        assert job.done and job.generated < 20  # left after a few steps, not after 60


def test_an_encoder_decoder_answers_completions_with_the_prompt_as_its_source(tmp_path):
    path = write_run(tmp_path / "s2s", arch="encoder-decoder", positional="sinusoidal")
    run = qkv.load(path)
    with Live(path) as server:
        got = server.client().completions.create(model="s2s", prompt="where is the cat?", max_tokens=20,
                                                 temperature=0)
        with pytest.raises(openai.BadRequestError):
            server.client().completions.create(model="s2s", prompt="x", echo=True, max_tokens=1)
    assert got.choices[0].text == generate_text(run, "where is the cat?", max_new_tokens=20, strategy="greedy",
                                                temperature=1.0, top_k=50, top_p=1.0, num_beams=1, seed=0)


def test_a_chat_template_from_tokenizer_config_is_rendered_with_its_special_tokens(tmp_path):
    path = write_run(tmp_path / "tmpl")
    template = ("{% for m in messages %}<|endoftext|>{{ m.role }}\n{{ m.content }}{% endfor %}"
                "{% if add_generation_prompt %}<|endoftext|>assistant\n{% endif %}")
    (path / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    run = qkv.load(path)
    with Live(path) as server:
        result = server.client().chat.completions.create(
            model="tmpl", messages=[{"role": "user", "content": "hi"}], max_tokens=5, temperature=0)
    eos, encode = run.tokenizer.eos_id, run.tokenizer.encode
    ids = [eos] + encode("user\nhi") + [eos] + encode("assistant\n")
    assert result.usage.prompt_tokens == len(ids)


def test_sigterm_finishes_the_requests_in_flight_and_exits_0(tmp_path):
    path = write_run(tmp_path / "big", d_model=256, n_layers=4, d_ff=1024, max_seq_len=512)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "qkv", "serve", str(path), "--port", "0"], env=env,
                            stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stderr.readline()
        assert "serving big" in line, line
        url = line.split(" on ")[1].split()[0]
        body = {"model": "big", "prompt": "the", "max_tokens": 480, "stream": True}
        chunks, at_signal = [], None
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as response:
            for data in response.iter_lines():
                if data.startswith("data: "):
                    chunks.append(data[6:])
                if len(chunks) == 3:
                    at_signal = len(chunks)
                    proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
        assert at_signal == 3 and chunks[-1] == "[DONE]"
        finish = json.loads(chunks[-2])["choices"][0]["finish_reason"]
        assert finish in ("stop", "length")  # the stream in flight was finished, not cut
        with pytest.raises(httpx.ConnectError):
            httpx.get(url + "/health")
        assert "server stopped" in proc.stderr.read()
    finally:
        proc.kill()
        proc.wait()


def test_bad_serve_options_exit_2_with_one_line(tmp_path, run_dir):
    for args in (["serve", str(tmp_path / "missing")], ["serve", str(run_dir), "--port", "70000"],
                 ["serve", str(run_dir), "--max-batch", "0"]):
        proc = subprocess.run([sys.executable, "-m", "qkv", *args], capture_output=True, text=True, timeout=60)
        assert proc.returncode == 2 and proc.stderr.startswith("qkv: error: ") and proc.stderr.count("\n") == 1


def test_serve_compile_refuses_a_model_the_compiled_step_does_not_cover(tmp_path):
    path = write_run(tmp_path / "s2s", arch="encoder-decoder", positional="sinusoidal")
    proc = subprocess.run([sys.executable, "-m", "qkv", "serve", str(path), "--port", "0", "--compile"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.splitlines()[-1] == ("qkv: error: --compile: the compiled decoding step does not cover "
                                            "EncoderDecoder models (the compiled step is for decoder-only ones)")


def test_a_hugging_face_dir_is_served_and_greedy_matches_transformers_generate(tmp_path):
    """Oracle: transformers' own GPT2LMHeadModel.generate on the same weights (the dir qkv serves)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from tests.serve.live import tokenizer

    tok = tokenizer()
    torch.manual_seed(0)
    hf = GPT2LMHeadModel(GPT2Config(vocab_size=tok.vocab_size, n_positions=64, n_embd=32, n_layer=2, n_head=4,
                                    initializer_range=0.3, eos_token_id=tok.eos_id, bos_token_id=tok.eos_id)).eval()
    path = tmp_path / "gpt2-tiny"
    hf.save_pretrained(path)
    tok.save(path / "tokenizer.json")
    prompt = [tok.eos_id] + tok.encode("the cat")
    with torch.no_grad():
        new = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, pad_token_id=tok.eos_id)
    new = new[0, len(prompt):].tolist()
    new = new[:new.index(tok.eos_id)] if tok.eos_id in new else new
    with Live(path) as server:
        got = server.client().completions.create(model="gpt2-tiny", prompt="the cat", max_tokens=12, temperature=0)
    assert got.choices[0].text == tok.decode(new)


def test_serve_at_a_precision_says_it_and_warns_where_batches_may_change_tokens(run_dir):
    from qkv.serve.server import prepare

    lines = []
    served = prepare(str(run_dir), dtype="fp32", quant="int8", log=lines.append)
    assert any(line.startswith("qkv: serving at int8 weights") for line in lines)
    assert not any("warning" in line for line in lines)
    lines.clear()
    prepare(str(run_dir), dtype="bf16", quant="none", log=lines.append)
    assert any("warning" in line and "--dtype fp32 keeps them independent" in line for line in lines)
    assert served.run.model.lm_head is not None
