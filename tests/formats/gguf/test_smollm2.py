"""SmolLM2-135M-Instruct from its GGUF file (llama architecture, 30 layers, GQA 9/3, Q4_1 and Q8_0 tensors,
ChatML), end to end against transformers reading the same file: logits, greedy text, the tokenizer on the
bundled works and hostile strings, the chat, and qkv serve's chat completions through the openai client."""
import pytest
import torch

from qkv.formats.base import Chat
from qkv.formats.chat import template_for
from qkv.generate import weights
from qkv.generate.chat import ChatSession
from tests.formats.gguf.smollm2 import (bundled_works, greedy_as_transformers, lora_sft_loads_in_peft, require_smollm2,
                                       shipped_as_dequantized, with_transformers)
from tests.formats.gguf.test_tokenizer import HOSTILE

PROMPTS = ["The capital of France is", "To be, or not to be,", "def fibonacci(n):", "1, 2, 3, 5, 8,",
           "<|im_start|>user\nHello!<|im_end|>\n<|im_start|>assistant\n"]


@pytest.fixture(scope="module")
def smol():
    return with_transformers(require_smollm2())


def test_logits_equal_transformers_on_five_prompts(smol):
    run, theirs, _ = smol
    for prompt in PROMPTS:
        ids = torch.tensor([run.tokenizer.encode_with_specials(prompt)])
        with torch.no_grad():
            diff = (run.model(ids) - theirs(ids).logits).abs().max().item()
        assert diff < 1e-4, (prompt, diff)


def test_its_q4_1_blocks_run_as_shipped_with_the_dequantized_logits(smol):
    shipped_as_dequantized(smol[0], PROMPTS[:2], {"Q4_1": 210, "Q8_0": 1})  # (the head: the Q8_0 embedding)


def test_calc_counts_the_real_parameters(smol):
    from qkv.analysis import calc

    run, theirs, _ = smol
    total = calc.calculate(run.config)["params"]["total"]
    assert total == sum(p.numel() for p in theirs.parameters()) == 134_515_008


def test_greedy_64_tokens_are_transformers(smol):
    run, theirs, _ = smol
    greedy_as_transformers(run, theirs, run.tokenizer.encode_with_specials(PROMPTS[1]), 64)


def test_the_tokenizer_equals_transformers_on_every_bundled_work_and_hostile_strings(smol):
    run, _, tokenizer = smol
    works = bundled_works()
    assert len(works) > 40
    for text in works + HOSTILE:
        assert run.tokenizer.encode_with_specials(text) == tokenizer(text, add_special_tokens=False).input_ids


def test_the_chat_names_paris_and_stops_at_the_end_of_its_turn(smol):
    run, _, tokenizer = smol
    assert run.chat.template and run.chat.stop_ids == (tokenizer.convert_tokens_to_ids("<|im_end|>"),)
    template = template_for(run.chat, run.tokenizer)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    ids, _ = template(messages)
    assert ids == tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                return_dict=False)
    session = ChatSession(run, template, strategy="greedy", max_new_tokens=30)
    reply = session.say(messages[0]["content"])
    assert "Paris" in reply and "<|im_end|>" not in reply
    assert template_for(Chat(), run.tokenizer).stop  # a run without a template has the plain default


def test_serve_speaks_chatml_and_stops_at_im_end(smol):
    import openai

    from tests.serve.live import Live

    path = require_smollm2()
    with Live(path, name="smol") as live:
        client = openai.OpenAI(base_url=live.url + "/v1", api_key="none")
        reply = client.chat.completions.create(model="smol", messages=[
            {"role": "user", "content": "What is the capital of France?"}], max_tokens=30, temperature=0,
            logprobs=True, top_logprobs=2)
        chunks = list(client.chat.completions.create(model="smol", messages=[
            {"role": "user", "content": "What is the capital of France?"}], max_tokens=30, temperature=0,
            stream=True))
    text = reply.choices[0].message.content
    assert "Paris" in text and "<|im_end|>" not in text and reply.choices[0].finish_reason == "stop"
    assert reply.usage.prompt_tokens == len(smol[2].apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}], add_generation_prompt=True, tokenize=True,
        return_dict=False))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    run = weights.load(path)  # the first token's logprob is log softmax of the logits of the model as served (the
    weights.prepare(run.model)  # file's blocks as shipped) after the prompt
    prompt = template_for(run.chat, run.tokenizer)([{"role": "user", "content": "What is the capital of France?"}])[0]
    with torch.no_grad():
        expected = torch.log_softmax(run.model(torch.tensor([prompt]))[0, -1].double(), -1)
    first = reply.choices[0].logprobs.content[0]
    assert abs(first.logprob - expected.max().item()) < 1e-4 and len(first.top_logprobs) == 2


def test_lora_sft_of_the_real_file_end_to_end(smol, tmp_path):
    """A few LoRA SFT steps on SmolLM2 itself (ChatML rows): the loss falls, the adapters load in peft onto
    transformers' reading of the same file with qkv's logits."""
    ours, theirs, _ = smol
    lora_sft_loads_in_peft(ours, theirs, tmp_path)
