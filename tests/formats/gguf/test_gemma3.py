"""Gemma 3 270M from its GGUF file as shipped (gemma3: 18 layers, five 512-key sliding layers to one global, RoPE
bases 10,000 / 1,000,000, head_dim 256 with D = 640, q/k norms, four norms a block, embeddings times sqrt(D), a
262,144-piece SentencePiece vocabulary without a space prefix; Q8_0, Q5_0, Q4_K and Q6_K tensors) end to end
against transformers reading the same file: logits on five prompts (one longer than the window), greedy text,
the tokenizer on the bundled works and hostile strings, and the parameter count."""
import gzip
import json
from importlib import resources

import pytest
import torch

import qkv
from qkv.generate import generate
from tests.formats.gguf.smollm2 import require_gemma3
from tests.formats.gguf.test_tokenizer import HOSTILE

LONG = " ".join(["Friends, Romans, countrymen, lend me your ears; I come to bury Caesar, not to praise him."] * 40)
PROMPTS = ["The capital of France is", "To be, or not to be,", "def fibonacci(n):", "1, 2, 3, 5, 8,", LONG]


@pytest.fixture(scope="module")
def gemma():
    path = require_gemma3()
    import transformers

    theirs = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                               dtype=torch.float32).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    return qkv.load(path), theirs, tokenizer


def test_logits_equal_transformers_on_five_prompts(gemma):
    run, theirs, tokenizer = gemma
    for prompt in PROMPTS:
        ids = [run.tokenizer.start_id] + run.tokenizer.encode(prompt)
        assert ids == tokenizer(prompt).input_ids  # <bos> first, as the file asks (add_bos_token)
        ids = torch.tensor([ids])
        with torch.no_grad():
            ours, expected = run.model(ids), theirs(ids).logits
        diff = (ours - expected).abs().max().item()
        assert diff < 1e-4 * expected.abs().max().item(), (prompt[:30], ids.shape, diff)
    assert ids.shape[1] > run.model.blocks[0].attn.sliding  # the long prompt reaches past the window


def test_paris_is_third_and_the_parameters_are_the_files(gemma):
    from qkv.analysis import calc

    run, theirs, _ = gemma
    ids = torch.tensor([[run.tokenizer.start_id] + run.tokenizer.encode("The capital of France is")])
    with torch.no_grad():
        top = run.model(ids)[0, -1].topk(3).indices.tolist()
    assert run.tokenizer.decode([top[2]]) == " Paris"
    total = calc.calculate(run.config)["params"]["total"]
    assert total == sum(p.numel() for p in theirs.parameters()) == 268_098_176


def test_greedy_32_tokens_are_transformers(gemma):
    run, theirs, _ = gemma
    ids = torch.tensor([[run.tokenizer.start_id] + run.tokenizer.encode(PROMPTS[1])])
    ours = generate(run.model, ids, max_new_tokens=32, strategy="greedy")
    with torch.no_grad():
        expected = theirs.generate(ids, max_new_tokens=32, do_sample=False, eos_token_id=None)
    assert ours.tolist() == expected.tolist()


def test_the_tokenizer_equals_transformers_on_every_bundled_work_and_hostile_strings(gemma):
    run, _, tokenizer = gemma
    corpus = resources.files("qkv.data") / "corpora" / "shakespeare.jsonl.gz"
    with gzip.open(corpus.open("rb"), "rt", encoding="utf-8") as f:
        works = [json.loads(line)["text"][:10_000] for line in f]
    assert len(works) > 40
    for text in works + HOSTILE:  # qkv spells Gemma's end of text <eos> as <|endoftext|> (docs/DEVIATIONS.md)
        theirs = tokenizer(text.replace("<|endoftext|>", "<eos>"), add_special_tokens=False).input_ids
        assert run.tokenizer.encode_with_specials(text) == theirs, text[:40]
