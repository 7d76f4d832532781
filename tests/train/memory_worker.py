"""One torchrun launch (2 processes, gloo) for tests/train/test_rank_memory.py and benchmarks/rank_memory.py:
every rank trains one step of each layout of LAYOUTS with the Trainer and records what it holds
(qkv.train.memory.state_bytes): the weights at the end of the forward (a step's peak: FSDP2's units are
gathered then), the gradients after the backward and the optimizer states after the update.

Rank r writes OUT/memory{r}.json: {layout/precision: {weights, gradients, optimizer_states}}.
Usage: torchrun --standalone --nproc-per-node 2 -m tests.train.memory_worker OUT TEXT [SET ...]
"""
from __future__ import annotations

import dataclasses
import json
import os
import sys
from pathlib import Path

import torch

from qkv import presets
from qkv.data.sources import prepare_data
from qkv.train.loop import Trainer
from qkv.train.memory import state_bytes

LAYOUTS = {  # name: settings, 2 ranks each
    "zero0": ["parallel.dp=2"], "zero1": ["parallel.dp=2", "parallel.zero=1"],
    "zero2": ["parallel.dp=2", "parallel.zero=2"], "zero3": ["parallel.dp=2", "parallel.zero=3"],
    "tp2": ["parallel.tp=2"], "pp2": ["parallel.pp=2", "parallel.microbatches=2"],
}
PRECISIONS = ("fp32", "bf16")


def config(text: str, layout: str, precision: str, extra: list[str]):
    cfg = presets.get("tiny").override(["data.vocab_size=280", "train.threads=1", "train.max_steps=1",
                                        "train.eval_every=0", "train.checkpoint_every=0",
                                        f"train.precision={precision}", *LAYOUTS[layout], *extra])
    return dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, paths=(text,)))


def measure(run_dir: Path, cfg) -> dict[str, int]:
    prepared = prepare_data(cfg.data)
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, vocab_size=prepared.tokenizer.vocab_size))
    trainer = Trainer(run_dir, cfg, prepared, progress=False, log=lambda message: None)
    seen: dict[str, int] = {}

    def after_forward(module, inputs, output):
        seen.setdefault("weights", state_bytes(trainer.model, trainer.optimizer)["weights"])

    hook = trainer.model.register_forward_hook(after_forward)
    clip = trainer.runner.clip

    def measured_clip(max_norm: float):
        seen.setdefault("gradients", state_bytes(trainer.model, trainer.optimizer)["gradients"])
        return clip(max_norm)

    trainer.runner.clip = measured_clip
    batch = [trainer.layout.shard(a) for a in trainer.batches.next()]
    trainer.step(*(torch.from_numpy(a) for a in batch), lr=1e-3)
    hook.remove()
    states = state_bytes(trainer.model, trainer.optimizer)
    seen.setdefault("weights", states["weights"])  # a pipeline stage's forward runs inside the schedule
    return {**seen, "optimizer_states": states["optimizer_states"], "vocab_size": cfg.model.vocab_size}


def main(out: str, text: str, *extra: str) -> None:
    rank = int(os.environ["RANK"])
    results = {}
    for layout in LAYOUTS:
        for precision in PRECISIONS:
            results[f"{layout}/{precision}"] = measure(Path(out) / f"{layout}-{precision}", config(text, layout, precision, list(extra)))
    Path(out, f"memory{rank}.json").write_text(json.dumps(results))


if __name__ == "__main__":
    main(*sys.argv[1:])
