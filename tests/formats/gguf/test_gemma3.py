"""Gemma 3 270M from its GGUF file as shipped (gemma3: 18 layers, five 512-key sliding layers to one global, RoPE
bases 10,000 / 1,000,000, head_dim 256 with D = 640, q/k norms, four norms a block, embeddings times sqrt(D), a
262,144-piece SentencePiece vocabulary without a space prefix; Q8_0, Q5_0, Q4_K and Q6_K tensors) end to end
against transformers reading the same file: logits on five prompts (one longer than the window), greedy text,
the tokenizer on the bundled works and hostile strings, and the parameter count."""
import json

import pytest
import torch

from tests.formats.gguf.smollm2 import (bundled_works, greedy_as_transformers, lora_sft_loads_in_peft, require_gemma3,
                                       shipped_as_dequantized, with_transformers)
from tests.formats.gguf.test_tokenizer import HOSTILE

LONG = " ".join(["Friends, Romans, countrymen, lend me your ears; I come to bury Caesar, not to praise him."] * 40)
PROMPTS = ["The capital of France is", "To be, or not to be,", "def fibonacci(n):", "1, 2, 3, 5, 8,", LONG]


@pytest.fixture(scope="module")
def gemma():
    return with_transformers(require_gemma3())


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


def test_its_mixed_blocks_run_as_shipped_with_the_dequantized_logits(gemma):
    """Q4_K (int4), Q5_0, Q6_K and Q8_0 (int8g) layers and the Q8_0 head tied to the embedding."""
    shipped_as_dequantized(gemma[0], PROMPTS[:2], {"Q4_K": 27, "Q5_0": 81, "Q6_K": 9, "Q8_0": 10})


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
    greedy_as_transformers(run, theirs, [run.tokenizer.start_id] + run.tokenizer.encode(PROMPTS[1]), 32)


def test_the_tokenizer_equals_transformers_on_every_bundled_work_and_hostile_strings(gemma):
    run, _, tokenizer = gemma
    works = bundled_works()
    assert len(works) > 40
    for text in works + HOSTILE:  # qkv spells Gemma's end of text <eos> as <|endoftext|> (docs/DEVIATIONS.md)
        theirs = tokenizer(text.replace("<|endoftext|>", "<eos>"), add_special_tokens=False).input_ids
        assert run.tokenizer.encode_with_specials(text) == theirs, text[:40]


def test_the_commands_on_the_real_file(gemma, tmp_path):
    """qkv generate (greedy, as transformers), qkv eval (the loss transformers gives), the logit lens (ending at
    the model's own top token) and calc (the KV cache of 8,192 tokens with the sliding layers' rings)."""
    import math

    from tests.formats.hf import cli

    run, theirs, tokenizer = gemma
    path = str(run.path)
    code, out, _ = cli("generate", path, "--prompt", "The capital of France is", "--strategy", "greedy",
                       "--max-new-tokens", "12", "--quant", "none")  # (dequantized, as transformers reads it)
    ids = torch.tensor([tokenizer("The capital of France is").input_ids])
    with torch.no_grad():
        expected = theirs.generate(ids, max_new_tokens=12, do_sample=False, eos_token_id=None)[0, ids.shape[1]:]
    assert code == 0 and out.strip() == "The capital of France is" + tokenizer.decode(expected)
    text = tmp_path / "hamlet.txt"
    text.write_text("To be, or not to be, that is the question: Whether 'tis nobler in the mind to suffer")
    code, out, _ = cli("eval", path, "--data", str(text), "--json", "--quant", "none")
    scored = torch.tensor([tokenizer(text.read_text()).input_ids])
    with torch.no_grad():
        loss = float(theirs(scored, labels=scored).loss)  # mean nats over every token after <bos>
    assert code == 0 and json.loads(out)["loss"] == pytest.approx(loss, rel=1e-4)
    assert json.loads(out)["bits_per_char"] == pytest.approx(loss * (scored.shape[1] - 1) / math.log(2) /
                                                             len(text.read_text()), rel=1e-4)
    from qkv.analysis import calc  # (probe and calc on the loaded run: a CLI start reads the file for 10-15 s)
    from qkv.interp import logit_lens

    prompt = torch.tensor([run.tokenizer.bos_ids + run.tokenizer.encode("The capital of France is")])
    rows = logit_lens(run.model, prompt)
    assert prompt[0, 0] == 2 and rows[-1]["top"][0][0] == int(theirs(prompt).logits[0, -1].argmax())
    found = calc.calculate(run.config, seq=8192, batch=1, precision="fp32")
    assert found["kv_cache_bytes"] == (3 * 8192 + 15 * (512 + 16)) * 2 * 256 * 4  # 66.6 MB, against 302 MB


def test_the_servers_batch_keeps_the_sliding_layers_in_rings_and_each_request_equals_generate_alone(gemma,
                                                                                                  monkeypatch):
    """`qkv serve`'s engine on the real file: a prompt past the window (881 tokens) and two short ones decoded
    together, each row's sliding layers gathered into rings of 528 slots, the greedy tokens of each as
    `generate` gives them alone."""
    from qkv.generate import generate
    from qkv.nn.cache import RingLayerCache
    from qkv.serve import engine as engine_module
    from tests.serve.test_engine import Recorder

    run = gemma[0]
    texts = [[run.tokenizer.start_id] + run.tokenizer.encode(prompt) for prompt in (LONG, *PROMPTS[:2])]
    rings = []
    engine = engine_module.Engine(run.model, max_batch=4, threads=1)
    gather = engine_module.gather_rows

    def recorded(model, parts, room):
        out = gather(model, parts, room)
        rings.extend(layer.k.shape[2] for layer in out.layers if isinstance(layer, RingLayerCache))
        return out

    recorders = [Recorder() for _ in texts]
    monkeypatch.setattr(engine_module, "gather_rows", recorded)
    engine.start()
    try:
        engine.submit(*[r.job(ids, 8) for r, ids in zip(recorders, texts)])
        for recorder in recorders:
            assert recorder.done.wait(300)
    finally:
        engine.stop()
    assert rings and set(rings) == {512 + 16} and len(texts[0]) > 528
    for recorder, ids in zip(recorders, texts):
        with torch.no_grad():
            alone = generate(run.model, torch.tensor(ids), max_new_tokens=8)[len(ids):].tolist()
        assert recorder.tokens == alone


def test_lora_sft_of_the_real_file_loads_in_peft_with_qkvs_logits(gemma, tmp_path):
    run, theirs, _ = gemma
    lora_sft_loads_in_peft(run, theirs, tmp_path)


def test_its_sentencepiece_tokenizer_is_written_and_read_back(gemma, tmp_path):
    """Gemma's kind of tokenizer (no space prefix, pieces of spaces, <bos> first) out to GGUF and in again: the
    same ids for the hostile strings and runs of spaces, the same start token."""
    from qkv.formats.gguf.reader import GgufFile
    from qkv.formats.gguf.tokenizer import gguf_tokenizer
    from qkv.formats.gguf.writer import add_sentencepiece

    gguf = pytest.importorskip("gguf")
    original = gemma[0].tokenizer
    raw = json.loads(original.to_str())
    vocab = {**raw["model"]["vocab"], **{t["content"]: t["id"] for t in raw["added_tokens"]}}
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    writer = gguf.GGUFWriter(str(tmp_path / "tok.gguf"), "gemma3")
    add_sentencepiece(writer, raw, tokens, {t["content"] for t in raw["added_tokens"] if t.get("special")})
    writer.add_bos_token_id(original.start_id)
    writer.add_add_bos_token(True)
    writer.add_eos_token_id(original.eos_id)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    back = gguf_tokenizer(GgufFile.open(tmp_path / "tok.gguf").metadata, "written")
    assert back.start_id == original.start_id == 2
    for text in HOSTILE + ["  two spaces  and   three", "Whether 'tis nobler in the mind to suffer"]:
        assert back.encode_with_specials(text) == original.encode_with_specials(text), text
