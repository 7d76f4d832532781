"""Supervised fine-tuning (qkv.train.sft, qkv.data.sft): what the loss trains on, packing, bad rows, the command."""
import dataclasses
import gzip
import json
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import qkv
from qkv.config import ModelConfig
from qkv.data.sft import IGNORE, Examples, PackedBatches
from qkv.formats.chat import template_for
from qkv.models import build_model
from qkv.train import sft
from tests.cli.test_main import cli
from tests.formats.gguf import write_llama

CONVERSATIONS = [
    [{"role": "user", "content": "say one"}, {"role": "assistant", "content": "one moon"}],
    [{"role": "system", "content": "be brief"}, {"role": "user", "content": "and two"},
     {"role": "assistant", "content": "two seas"}, {"role": "user", "content": "more"},
     {"role": "assistant", "content": "three stars shine"}],
    [{"role": "user", "content": "sing"}, {"role": "assistant", "content": "the night doth sing upon the wind"}],
]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A random llama as a GGUF file with a ChatML template, loaded."""
    path = write_llama(tmp_path_factory.mktemp("sft") / "tiny.gguf")
    return path, qkv.load(path)


def rows_file(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


def test_assistant_turns_alone_are_trained(tiny):
    _, run = tiny
    template = template_for(run.chat, run.tokenizer)
    ids, trained = sft.encode_conversation(template, CONVERSATIONS[1], "row")
    text = template.render(CONVERSATIONS[1], add_generation_prompt=False)
    assert ids == run.tokenizer.encode_with_specials(text)  # ChatML: the pieces tokenize as the whole does
    spans = [run.tokenizer.decode([i for i, t in zip(ids, trained) if t])]
    assert spans == ["two seas<|im_end|>\nthree stars shine<|im_end|>\n"]
    untrained = run.tokenizer.decode([i for i, t in zip(ids, trained) if not t])
    assert "be brief" in untrained and "and two" in untrained and "assistant" in untrained


def test_prompt_completion_forms(tiny):
    _, run = tiny
    template = template_for(run.chat, run.tokenizer)
    ids, trained = sft.encode_row({"prompt": "sing", "completion": " the moon"}, "row", template, run.tokenizer)
    assert ids[-1] == run.tokenizer.eos_id and run.tokenizer.decode(np.array(ids)[trained][:-1]) == " the moon"
    prompt, completion = CONVERSATIONS[1][:4], CONVERSATIONS[1][4:]
    ids, trained = sft.encode_row({"prompt": prompt, "completion": completion}, "row", template, run.tokenizer)
    assert run.tokenizer.decode(np.array(ids)[trained]) == "three stars shine<|im_end|>\n"  # the prompt's turn not


def test_targets_are_the_next_trained_token():
    examples = Examples()
    examples.add([5, 6, 7, 8], [False, False, True, True], "row")
    assert examples.targets(0).tolist() == [IGNORE, 7, 8, IGNORE]


def model_variants(vocab: int) -> dict[str, torch.nn.Module]:
    base = ModelConfig(vocab_size=vocab, d_model=32, n_heads=4, n_layers=2, d_ff=64, max_seq_len=128)
    variants = {"gpt2": dict(positional="learned", bias=True),
                "llama": dict(positional="rope", norm="rmsnorm", ffn="glu", activation="silu", n_kv_heads=2),
                "qwen2": dict(positional="rope", norm="rmsnorm", ffn="glu", activation="silu", bias=True),
                "alibi": dict(positional="alibi"), "bigram": dict(positional="rope", bigram_vocab=256)}
    torch.manual_seed(0)
    return {name: build_model(dataclasses.replace(base, **changes)).eval() for name, changes in variants.items()}


@pytest.mark.parametrize("family", ["gguf", "gpt2", "llama", "qwen2", "alibi", "bigram"])
def test_packed_losses_equal_each_conversation_alone(tiny, family):
    path, run = tiny
    model = run.model if family == "gguf" else model_variants(run.config.model.vocab_size)[family]
    template = template_for(run.chat, run.tokenizer)
    examples = Examples()
    for i, messages in enumerate(CONVERSATIONS * 2):
        examples.add(*sft.encode_conversation(template, messages, f"row {i}"), f"row {i}")
    longest = max(len(ids) for ids in examples.ids)
    batches = PackedBatches(examples, longest + 20, 2, seed=0, pad_id=run.tokenizer.eos_id)
    inputs, targets, documents, scale = (torch.from_numpy(a) for a in batches.next())
    assert scale[0] == pytest.approx(inputs.shape[0] / int((targets != IGNORE).sum()))
    assert documents.max() >= 1  # a row holds more than one conversation
    with torch.no_grad():
        logits = model(inputs, documents=documents)
        packed = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE, reduction="none")
        packed = packed[targets.flatten() != IGNORE]
        alone = []
        for row in range(inputs.shape[0]):
            for doc in documents[row].unique().tolist():
                columns = (documents[row] == doc).nonzero().flatten()
                ids, wanted = inputs[row, columns][None], targets[row, columns]
                if (wanted != IGNORE).any():
                    losses = F.cross_entropy(model(ids)[0], wanted, ignore_index=IGNORE, reduction="none")
                    alone.append(losses[wanted != IGNORE])
        alone = torch.cat(alone)
        torch.testing.assert_close(packed, alone, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(sft.loss(model, (inputs, targets, documents, scale), 0.0), alone.mean(),
                                   rtol=1e-5, atol=1e-6)  # the whole batch: the mean over its trained tokens


def test_every_example_once_per_epoch_and_the_state_resumes():
    examples = Examples()
    for i in range(7):
        examples.add([i] * (3 + i), [True] * (3 + i), f"row {i}")
    batches = PackedBatches(examples, 12, 2, seed=3, pad_id=99)
    seen = []
    while batches.epoch == 0:
        state = batches.state()
        inputs, _, documents, _ = batches.next()
        for row, docs in zip(inputs, documents):
            seen += [int(row[docs == d][0]) for d in np.unique(docs) if row[docs == d][0] != 99]
    assert sorted(seen[:7]) == list(range(7))  # the first epoch: each example once, never cut
    again = PackedBatches(examples, 12, 2, seed=3, pad_id=99)
    again.load_state(state)
    batches.load_state(state)
    assert all(np.array_equal(a, b) for a, b in zip(again.next(), batches.next()))


@pytest.mark.parametrize("row, message", [
    ({"messages": [{"role": "narrator", "content": "x"}, {"role": "assistant", "content": "y"}]}, "role 'narrator'"),
    ({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": " "}]}, "empty assistant turn"),
    ({"messages": [{"role": "user", "content": "x"}]}, "no assistant turn"),
    ({"text": "plain"}, "expected {\"messages\""),
    ({"prompt": "x", "completion": ""}, "empty completion"),
    ({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "moon " * 400}]},
     "longer than train.seq_len"),
])
def test_a_bad_row_is_an_error_naming_it(tiny, tmp_path, capsys, row, message):
    path, _ = tiny
    data = rows_file(tmp_path / "rows.jsonl", [{"prompt": "a", "completion": "b"}, row])
    rc, out, err = cli(capsys, "train", "--task", "sft", "--init", str(path), "--data", str(data), "--out",
                       str(tmp_path / "run"), "--max-steps", "1", "--quiet")
    assert rc == 2 and "rows.jsonl:2: " in err and message in err and "Traceback" not in err, err
    assert not (tmp_path / "run").exists()


def test_a_row_that_is_not_utf8_is_named(tiny, tmp_path, capsys):
    path, _ = tiny
    data = tmp_path / "rows.jsonl.gz"
    data.write_bytes(gzip.compress(b'{"prompt": "a", "completion": "b"}\n{"prompt": "\xff", "completion": "b"}\n'))
    rc, _, err = cli(capsys, "train", "--task", "sft", "--init", str(path), "--data", str(data), "--out",
                     str(tmp_path / "run"), "--max-steps", "1", "--quiet")
    assert rc == 2 and "rows.jsonl.gz:2: not UTF-8" in err, err


def test_sft_needs_init_and_data(tmp_path, capsys):
    rc, _, err = cli(capsys, "train", "--task", "sft", "--out", str(tmp_path / "run"), "--max-steps", "1")
    assert rc == 2 and "--init" in err, err


def test_sft_trains_resumes_and_chats_as_its_init(tiny, tmp_path, capsys):
    path, run = tiny
    rows = [{"messages": [{"role": "user", "content": f"count {i}"},
                          {"role": "assistant", "content": "the moon doth sing"}]} for i in range(30)]
    data = rows_file(tmp_path / "rows.jsonl", rows)
    out = tmp_path / "run"
    common = ["--set", "train.seq_len=64", "--set", "train.batch_size=4", "--set", "train.threads=1",
              "--set", "train.precision=fp32", "--set", "train.lr=3e-3", "--set", "train.warmup_steps=2",
              "--set", "train.log_every=1", "--quiet", "--no-sample", "--json"]
    rc, stdout, err = cli(capsys, "train", "--task", "sft", "--init", str(path), "--data", str(data), "--out",
                          str(out), "--max-steps", "30", *common[:-3], "--set", "train.checkpoint_every=15",
                          "--quiet", "--no-sample", "--json")
    assert rc == 0, err
    summary = json.loads(stdout)
    metrics = (out / "metrics.csv").read_text().splitlines()
    header = metrics[0].split(",")
    column = header.index("loss")
    losses = [float(line.split(",")[column]) for line in metrics[1:] if line.split(",")[column]]
    assert losses[-1] < 0.5 * losses[0] and summary["val_loss"] < 0.5 * losses[0], losses  # the reply is learnt
    trained = qkv.load(out)
    assert trained.chat == run.chat  # chat.json: it chats with its init's template and stops
    rc, _, err = cli(capsys, "train", "--out", str(out), "--resume", "--max-steps", "32", "--quiet", "--no-sample")
    assert rc == 0 and "resuming from the checkpoint at step 30" in err, err
