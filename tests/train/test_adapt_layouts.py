"""SFT, LoRA and DPO under torchrun (2 gloo processes: dp=2, and ZeRO / FSDP2 for a full fine-tune) give the
losses of one process, as the pretraining layouts do (tests/train/test_layouts.py)."""
from __future__ import annotations

import json

import numpy as np
import pytest

from qkv.cli import main
from tests.formats.gguf import write_llama
from tests.train import torchrun
from tests.train.test_layouts import curve

STEPS = 6


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("adapt")
    init = write_llama(root / "tiny.gguf")
    sft = [{"messages": [{"role": "user", "content": f"count {i}"},
                         {"role": "assistant", "content": "the moon " * (1 + i % 4)}]} for i in range(24)]
    pairs = [{"prompt": f"line {i}", "chosen": " the moon", "rejected": " a sea" * (1 + i % 3)} for i in range(24)]
    (root / "sft.jsonl").write_text("".join(json.dumps(r) + "\n" for r in sft))
    (root / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in pairs))
    return root, init


def command(root, init, task: str, out, *extra: str) -> list[str]:
    data = root / ("sft.jsonl" if task == "sft" else "pairs.jsonl")
    sets = ["train.seq_len=64", "train.batch_size=4", "train.accumulation=2", "train.precision=fp32",
            "train.threads=1", "train.lr=3e-3", "train.log_every=1", "train.warmup_steps=1", "train.eval_batches=2",
            "model.dropout=0.0"]
    return ["train", "--task", task, "--init", str(init), "--data", str(data), "--out", str(out), "--max-steps",
            str(STEPS), "--quiet", "--no-sample", *extra, *[x for s in sets for x in ("--set", s)]]


@pytest.mark.parametrize("task, extra, layout", [
    ("sft", ["--lora", "r=4,alpha=8,dropout=0"], ["parallel.dp=2"]),
    ("sft", [], ["parallel.dp=2", "parallel.zero=3"]),
    ("dpo", ["--lora", "r=4,alpha=8,dropout=0"], ["parallel.dp=2"]),
    ("dpo", [], ["parallel.dp=2", "parallel.zero=1"]),
])
def test_two_processes_give_one_process_losses(inputs, tmp_path, task, extra, layout):
    root, init = inputs
    assert main(command(root, init, task, tmp_path / "one", *extra)) == 0
    torchrun(2, ["-m", "qkv", *command(root, init, task, tmp_path / "two", *extra,
                                       *[x for s in layout for x in ("--set", s)])])
    one, two = curve(tmp_path / "one"), curve(tmp_path / "two")
    assert len(one["loss"]) == len(two["loss"]) == STEPS
    np.testing.assert_allclose(two["loss"], one["loss"], rtol=1e-5)
    np.testing.assert_allclose(two["val"][-1], one["val"][-1], rtol=1e-5)
    if extra:  # LoRA: rank 0 wrote the adapters in PEFT's format
        assert (tmp_path / "two" / "adapter_model.safetensors").is_file()
