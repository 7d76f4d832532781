"""Two gloo processes for tests/train/test_tensor_parallel.py and test_pipeline.py: `results()` starts them
once per test session (each start costs seconds) for every case of CASES, run as

    RANK=r WORLD_SIZE=2 <store_env> PYTHONPATH=. python tests/train/model_parallel_worker.py CASES.json OUT

(store_env: MASTER_ADDR and MASTER_PORT of the store the test process holds, tests/train/__init__.py).

A case: {"mode": "tp" | "pp", "model": {ModelConfig fields}, "parallel": {ParallelConfig fields}, "steps",
"batch", "seq", "label_smoothing" (tp)}. Every rank also trains the same model in one process (the oracle) on the same batches, with
the same AdamW and clipping, and writes per case to OUT/rank{r}.json: both runs' losses, (||g - g_ref||,
||g_ref||) for every gradient of the first step and, for pp, which parameters and moments the rank holds and
(rank 0) every weight and Adam moment gathered by `full_state`.
"""
from __future__ import annotations

import functools
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from qkv.config import ModelConfig, ParallelConfig, RunConfig, TrainConfig
from qkv.models.build import build_model
from qkv.nn.linear_cross_entropy import cross_entropy, vocab_parallel_loss
from qkv.parallel import pipeline
from qkv.parallel import tensor as tensor_parallel
from qkv.train.objectives import lm_loss
from tests.train import held_store, launch_env, store_env

LR, CLIP = 1e-2, 1.0
SMALL = {"vocab_size": 64, "d_model": 32, "n_heads": 4, "n_layers": 2, "d_ff": 64, "max_seq_len": 32}
LLAMA = {**SMALL, "n_kv_heads": 2, "positional": "rope", "norm": "rmsnorm", "ffn": "glu", "activation": "silu",
         "tie_embeddings": False, "bias": False}
CASES = {  # 10 steps each: batch 8 x 16 tokens (pp: 2-4 micro-batches)
    # GPT-2 style: learned positions, LayerNorm, tied W_E (split over V in the embedding and the head)
    "tp_gpt": {"mode": "tp", "model": SMALL},
    # the same with label smoothing: loss_parallel has none, the logits are gathered for it
    "tp_gpt_smoothed": {"mode": "tp", "model": SMALL, "label_smoothing": 0.1},
    # LLaMA style: RoPE, RMSNorm, SwiGLU (gate split like up), GQA with 2 key/value heads (1 per rank), untied;
    # with a hashed bigram table (split over its rows as W_E)
    "tp_llama": {"mode": "tp", "model": {**LLAMA, "bigram_vocab": 40}},
    # one layer each (the two above chain layers): Post-LN (norm outputs go back into the stream, the last
    # one into the head) with ALiBi (each rank its heads' slopes); sandwich norms (two per sublayer) with
    # sinusoidal positions and the naive kernel
    "tp_post_alibi": {"mode": "tp", "model": {**SMALL, "n_layers": 1, "positional": "alibi",
                                              "norm_placement": "post"}},
    "tp_sandwich": {"mode": "tp", "model": {**SMALL, "n_layers": 1, "positional": "sinusoidal",
                                            "norm_placement": "sandwich", "attention": "naive"}},
    # GPipe, 3 layers over 2 stages (2 + 1), tied W_E on the first and the last stage
    "pp_gpipe_tied": {"mode": "pp", "model": {**SMALL, "n_layers": 3},
                      "parallel": {"pp": 2, "schedule": "gpipe", "microbatches": 4}},
    # 1F1B with as many micro-batches as stages, LLaMA style, the bigram table on the first stage
    "pp_1f1b_llama": {"mode": "pp", "model": {**LLAMA, "bigram_vocab": 40}, "parallel": {"pp": 2, "schedule": "1f1b", "microbatches": 2}},
    # 1F1B with Shaw's relative positions: one table read by every layer of both stages
    "pp_1f1b_shaw": {"mode": "pp", "model": {**SMALL, "positional": "shaw", "attention": "naive"},
                     "parallel": {"pp": 2, "schedule": "1f1b", "microbatches": 4}},
    # GPipe with 2-step accumulation: 2 schedules of 2 micro-batches of 2 rows per step
    "pp_gpipe_accumulated": {"mode": "pp", "model": SMALL, "train": {"accumulation": 2},
                             "parallel": {"pp": 2, "schedule": "gpipe", "microbatches": 2}},
}


@functools.cache
def results() -> dict:
    """Rank 0's and rank 1's results for every case, from one 2-process launch."""
    out = Path(tempfile.mkdtemp(prefix="qkv-model-parallel-"))
    cases = [{"name": name, "steps": 10, "batch": 8, "seq": 16, "parallel": {}, **case} for name, case in CASES.items()]
    (out / "cases.json").write_text(json.dumps(cases))
    store = held_store()
    env = {**launch_env(), "WORLD_SIZE": "2", **store_env(store)}
    procs = [subprocess.Popen([sys.executable, __file__, str(out / "cases.json"), str(out)],
                              env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for rank in range(2)]
    logs = [proc.communicate(timeout=600)[0] for proc in procs]
    for proc, log in zip(procs, logs):
        assert proc.returncode == 0, log[-4000:]
    return {rank: json.loads((out / f"rank{rank}.json").read_text()) for rank in range(2)}


def optimizer(params) -> torch.optim.Optimizer:
    # eps 1e-6: a key bias's gradient is 0 up to rounding, and Adam with a tiny eps turns rounding into +-lr
    return torch.optim.AdamW(params, lr=LR, weight_decay=0.1, eps=1e-6, foreach=True)


def full(tensor: torch.Tensor) -> torch.Tensor:
    return (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).clone()  # clipping scales in place


def batches(cfg: ModelConfig, steps: int, batch: int, seq: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    out = []
    for _ in range(steps):
        ids = torch.randint(cfg.vocab_size, (batch, seq + 1), generator=generator)
        out.append((ids[:, :-1], ids[:, 1:]))
    return out


def final_state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Every weight and its Adam moment m after the last step."""
    state = {name: p.detach().clone() for name, p in model.named_parameters()}
    state.update({f"{name}:exp_avg": opt.state[p]["exp_avg"].clone() for name, p in model.named_parameters()})
    return state


def whole_loss(model: torch.nn.Module, inputs, targets, smoothing: float) -> torch.Tensor:
    """The oracle's loss: F.cross_entropy of the whole logits, and its backward."""
    loss = cross_entropy(model(inputs), targets, smoothing)
    loss.backward()
    return loss


def training_loss(model: torch.nn.Module, inputs, targets, smoothing: float) -> torch.Tensor:
    """The training step's loss (objectives.lm_loss) and its backward, inside the vocabulary-parallel loss as
    the Trainer runs it: tensor parallel's logits split over V (or gathered, with label smoothing)."""
    with vocab_parallel_loss():
        loss = lm_loss(model, (inputs, targets), smoothing)
        loss.backward()
    return loss


def train_steps(model: torch.nn.Module, opt, data, first_grad, step_loss=whole_loss,
                smoothing: float = 0.0) -> tuple[list[float], dict[str, torch.Tensor]]:
    """`opt` with clipping over `data`: the losses, and first_grad(p.grad) of every parameter at step 0."""
    losses, grads = [], {}
    for step, (inputs, targets) in enumerate(data):
        loss = step_loss(model, inputs, targets, smoothing)
        if step == 0:
            grads = {name: first_grad(p.grad) for name, p in model.named_parameters()}
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, grads


def reference(cfg: ModelConfig, data, smoothing: float = 0.0) -> tuple[list[float], dict[str, torch.Tensor],
                                                                      dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    model = build_model(cfg)
    opt = optimizer(model.parameters())
    losses, grads = train_steps(model, opt, data, torch.Tensor.clone, smoothing=smoothing)
    return losses, grads, final_state(model, opt)


def tensor_parallel_run(cfg: ModelConfig, data, smoothing: float) -> tuple[list[float], dict[str, torch.Tensor],
                                                                           int]:
    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))
    model = tensor_parallel.apply(build_model(cfg), mesh["tp"], cfg)
    with torch.no_grad():
        width = model(data[0][0]).to_local().shape[-1]  # the rank's slice of the vocabulary
    return (*train_steps(model, optimizer(model.parameters()), data, full, training_loss, smoothing), width)


def pipeline_run(cfg: RunConfig, data) -> tuple[list[float], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("pp",))
    runner = pipeline.Pipeline(build_model(cfg.model), mesh["pp"], cfg, torch.device("cpu"))
    opt = optimizer(runner.model.parameters())  # a whole-model optimizer: it skips parameters without gradients
    losses, grads = [], {}
    for step, (inputs, targets) in enumerate(data):
        loss, _ = runner.forward_backward((inputs, targets))
        if step == 0:
            grads = {name: p.grad.clone() for name, p in runner.named_parameters()}
        runner.clip(CLIP)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    resident = {name: not p.is_meta for name, p in runner.model.named_parameters()}
    moments = sorted(name for name, p in runner.model.named_parameters() if p in opt.state)
    weights, tensors, _ = runner.full_state(opt)  # rank 0: the whole model and optimizer state, gathered
    names = [name for name, _ in runner.model.named_parameters()]
    gathered = {**weights, **{f"{names[int(key.split('.')[1])]}:exp_avg": value for key, value in tensors.items()
                              if key.endswith(".exp_avg")}}
    return losses, grads, gathered, resident, moments


def difference(got: torch.Tensor, want: torch.Tensor) -> tuple[float, float]:
    """(||got - want||, ||want||): a key bias's gradient is 0 in exact arithmetic, so tests add an atol."""
    return (got - want).norm().item(), want.norm().item()


def main(cases_path: str, out_dir: str) -> None:
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    out = {}
    for case in json.loads(Path(cases_path).read_text()):
        cfg = ModelConfig(**case["model"]).validate()
        data = batches(cfg, case["steps"], case["batch"], case["seq"])
        smoothing = case.get("label_smoothing", 0.0)
        want_losses, want_grads, want_state = reference(cfg, data, smoothing)
        result = {"reference": want_losses, "reference_names": list(want_grads)}
        if case["mode"] == "tp":
            result["losses"], grads, result["logit_width"] = tensor_parallel_run(cfg, data, smoothing)
        else:
            run = RunConfig(model=cfg, train=TrainConfig(batch_size=case["batch"], seq_len=case["seq"],
                                                         **case.get("train", {})),
                            parallel=ParallelConfig(**case["parallel"])).validate()
            result["losses"], grads, full_state, result["resident"], result["moments"] = pipeline_run(run, data)
            result["synced"] = {name: difference(value, want_state[name])
                                for name, value in full_state.items() if name in want_state}  # not buffers
        result["grad_errors"] = {name: difference(grad, want_grads[name]) for name, grad in grads.items()}
        out[case["name"]] = result
    Path(out_dir, f"rank{dist.get_rank()}.json").write_text(json.dumps(out))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
