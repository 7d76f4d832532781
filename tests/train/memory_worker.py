"""One torchrun launch (2 processes, gloo) for tests/train/test_rank_memory.py and benchmarks/rank_memory.py:
every rank trains one step of each layout of LAYOUTS with the Trainer and records what it holds
(qkv.parallel.memory.state_bytes): the weights at the end of the forward (a step's peak: FSDP2's units are
gathered then), the gradients after the backward and the optimizer states after the update.

Then one step of each of PEAK_LAYOUTS (16 sequences of 64 tokens: activations matter) inside
qkv.analysis.measure.LiveBytes, after a first step has made the optimizer states: the rank's peak tensor
bytes (weights and states, + gradients, activations and transients).

Rank r writes OUT/memory{r}.json: {layout/precision: {weights, gradients, optimizer_states}, "peak": {layout/
precision: bytes}}.
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
from qkv.analysis.measure import LiveBytes, optimizer_tensors
from qkv.data.sources import prepare_data
from qkv.parallel import layout as parallel
from qkv.train.loop import Trainer
from qkv.parallel.memory import state_bytes

LAYOUTS = {  # name: settings, 2 ranks each
    "zero0": ["parallel.dp=2"], "zero1": ["parallel.dp=2", "parallel.zero=1"],
    "zero2": ["parallel.dp=2", "parallel.zero=2"], "zero3": ["parallel.dp=2", "parallel.zero=3"],
    "tp2": ["parallel.tp=2"], "pp2": ["parallel.pp=2", "parallel.microbatches=2"],
    "ep2": ["parallel.dp=2", "parallel.ep=2", "model.moe_experts=4"],
    "ep2_zero3": ["parallel.dp=2", "parallel.ep=2", "parallel.zero=3", "model.moe_experts=4"],
}
PRECISIONS = ("fp32", "bf16")
PEAK_LAYOUTS = {  # name: settings, 2 ranks each; 16 x 64 tokens per step
    "dp2": ["parallel.dp=2"], "tp2": ["parallel.tp=2"],
    "pp2-1f1b": ["parallel.pp=2", "parallel.microbatches=4", "parallel.schedule=1f1b"],
    "pp2-gpipe": ["parallel.pp=2", "parallel.microbatches=4", "parallel.schedule=gpipe"],
}
PEAK_SHAPE = ["train.batch_size=16", "train.seq_len=64"]


def config(text: str, settings: list[str], precision: str, extra: list[str]):
    cfg = presets.get("tiny").override(["data.vocab_size=280", "train.threads=1", "train.max_steps=2",
                                        "train.eval_every=0", "train.checkpoint_every=0",
                                        f"train.precision={precision}", *settings, *extra])
    return dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, paths=(text,)))


def trainer_for(run_dir: Path, cfg) -> Trainer:
    prepared = prepare_data(cfg.data)
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, vocab_size=prepared.tokenizer.vocab_size))
    return Trainer(run_dir, cfg, prepared, progress=False, log=lambda message: None)


def one_step(trainer: Trainer) -> None:
    batch = [trainer.layout.shard(a) for a in trainer.batches.next()]
    trainer.step(*(torch.from_numpy(a) for a in batch), lr=1e-3)


def peak(run_dir: Path, cfg) -> int:
    """The rank's peak tensor bytes in its second step (the first makes the optimizer states)."""
    trainer = trainer_for(run_dir, cfg)
    one_step(trainer)
    with LiveBytes(list(trainer.model.parameters()) + optimizer_tensors(trainer.optimizer)) as mode:
        one_step(trainer)
    return mode.peak_total


def measure(run_dir: Path, cfg) -> dict[str, int]:
    trainer = trainer_for(run_dir, cfg)
    seen: dict[str, int] = {}

    def after_forward(module, inputs, output):
        seen.setdefault("weights", state_bytes(trainer.model, trainer.optimizer)["weights"])

    hook = trainer.model.register_forward_hook(after_forward)
    clip = trainer.runner.clip

    def measured_clip(max_norm: float):
        seen.setdefault("gradients", state_bytes(trainer.model, trainer.optimizer)["gradients"])
        return clip(max_norm)

    trainer.runner.clip = measured_clip
    one_step(trainer)
    hook.remove()
    states = state_bytes(trainer.model, trainer.optimizer)
    seen.setdefault("weights", states["weights"])  # a pipeline stage's forward runs inside the schedule
    return {**seen, "optimizer_states": states["optimizer_states"], "vocab_size": trainer.cfg.model.vocab_size}


def main(out: str, text: str, *extra: str) -> None:
    rank = int(os.environ["RANK"])
    results = {}
    for layout in LAYOUTS:
        for precision in PRECISIONS:
            results[f"{layout}/{precision}"] = measure(Path(out) / f"{layout}-{precision}",
                                                       config(text, LAYOUTS[layout], precision, list(extra)))
    results["peak"] = {f"{layout}/{precision}": peak(Path(out) / f"peak-{layout}-{precision}",
                                                     config(text, [*settings, *PEAK_SHAPE], precision, list(extra)))
                       for layout, settings in PEAK_LAYOUTS.items() for precision in PRECISIONS}
    Path(out, f"memory{rank}.json").write_text(json.dumps(results))
    parallel.shutdown()  # gloo's threads joined before exit: one still running aborts the process at exit


if __name__ == "__main__":
    main(*sys.argv[1:])
