"""Claims about training: 21 (accumulation), 22 (data parallel), 26 (schedules), 27 (Adam), 30 (precisions)."""
from __future__ import annotations

import copy

import torch

from qkv.claims.base import Result, claim, status
from qkv.config import ModelConfig, ParallelConfig, RunConfig, TrainConfig
from qkv.models import build_model
from qkv.nn.linear_cross_entropy import cross_entropy
from qkv.parallel.layout import Layout
from qkv.schedules import SCHEDULES
from qkv.train.optim import OPTIMIZERS
from qkv.train.steps import MicroBatches

F64 = torch.float64


def _tiny_model():
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=50, d_model=16, n_heads=2, n_layers=2, d_ff=32, max_seq_len=16)
    return build_model(cfg).double(), cfg


def _grads(model, ids: torch.Tensor, scale: float = 1.0) -> None:
    """Accumulate d(scale * mean next-token CE)/d theta into .grad."""
    logits = model(ids[:, :-1])
    (scale * cross_entropy(logits.double(), ids[:, 1:])).backward()


def _flat_grads(model) -> torch.Tensor:
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()])


@claim(21, "gradient accumulation of k micro-batches equals one batch k times the size", "000 LLM §10.4")
def accumulation() -> Result:
    model, cfg = _tiny_model()
    ids = torch.randint(0, cfg.vocab_size, (8, 13), generator=torch.Generator().manual_seed(1))

    def backward(module, micro, share):  # as qkv.train.loop.Trainer.backward: the loss weighted by its share
        inputs, targets = micro
        loss = cross_entropy(module(inputs).double(), targets)
        (loss * share).backward()
        return loss.detach(), torch.zeros((), dtype=F64)

    grads, losses = [], []
    for k in (1, 4):  # one batch of 8, then k = 4 micro-batches of 2 through qkv's step runner
        runner = MicroBatches(model, RunConfig(model=cfg, train=TrainConfig(batch_size=8, accumulation=k)), Layout())
        model.zero_grad()
        losses.append(runner.forward_backward((ids[:, :-1], ids[:, 1:]), backward)[0].item())
        grads.append(_flat_grads(model))
    diff = (grads[0] - grads[1]).abs().max().item()
    return Result(status(diff < 1e-14 and abs(losses[0] - losses[1]) < 1e-14),
                  {"max|accumulated - full batch| gradient": diff, "loss (full, accumulated)": losses},
                  "qkv.train.steps.MicroBatches (the Trainer's step runner), float64, batch 8 = 4 x 2, each "
                  "micro-batch's loss weighted by its share of the rows. Exact because every micro-batch has the "
                  "same token count; with padding, equal per-token weighting needs the token counts.")


@claim(22, "data-parallel gradient averaging equals the full-batch gradient", "000 LLM §7.1")
def data_parallel() -> Result:
    import tempfile

    import torch.distributed as dist

    model, cfg = _tiny_model()
    ids = _dp_batch(cfg)
    _grads(model, ids)
    full = _flat_grads(model)
    if not dist.is_available():  # a torch build without torch.distributed: the average, in one process
        replicas = [copy.deepcopy(model) for _ in range(DP_RANKS)]
        for replica, shard in zip(replicas, ids.chunk(DP_RANKS)):
            replica.zero_grad()
            _grads(replica, shard)
        averaged, how = torch.stack([_flat_grads(r) for r in replicas]).mean(0), "simulated in one process"
    else:
        from safetensors.torch import load_file
        from torch.multiprocessing import start_processes

        with tempfile.TemporaryDirectory() as tmp:
            start_processes(_dp_rank, args=(DP_RANKS, tmp), nprocs=DP_RANKS, start_method="spawn")
            averaged = load_file(f"{tmp}/grads.safetensors")["grads"]
        how = f"{DP_RANKS} processes on a gloo group, qkv's DDP wrapper (qkv.parallel.layout) and step runner"
    diff = (full - averaged).abs().max().item()
    return Result(status(diff < 1e-14), {f"max|DDP gradient over {DP_RANKS} ranks - full batch|": diff},
                  f"{how}, float64, batch 8 split 4 + 4: DDP's all-reduce / K gives every rank "
                  "g = (1/K) sum_k g_k, the gradient of the whole batch (exact for equal shards of a mean loss).")


DP_RANKS = 2


def _dp_batch(cfg) -> torch.Tensor:
    return torch.randint(0, cfg.vocab_size, (8, 13), generator=torch.Generator().manual_seed(2))


def _dp_rank(rank: int, world: int, out: str) -> None:
    """One rank of claim 22: its shard of the batch through MicroBatches on a DDP-wrapped model; rank 0
    writes the gradient every rank now holds (safetensors). The ranks meet at a file in `out`: a port
    probed free could be taken by another process before rank 0 binds it."""
    import torch.distributed as dist
    from safetensors.torch import save_file
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{out}/rendezvous", rank=rank, world_size=world)
    try:
        model, cfg = _tiny_model()
        mesh = init_device_mesh("cpu", (1, world, 1), mesh_dim_names=("pp", "dp", "tp"))
        layout = Layout(rank=rank, world=world, dp=world, mesh=mesh, dp_rank=rank)
        run = RunConfig(model=cfg, train=TrainConfig(batch_size=8), parallel=ParallelConfig(dp=world))
        runner = MicroBatches(model, run, layout)
        shard = layout.shard(_dp_batch(cfg).numpy())

        def backward(module, micro, share):
            loss = cross_entropy(module(micro[0]).double(), micro[1])
            (loss * share).backward()
            return loss.detach(), torch.zeros((), dtype=F64)

        runner.forward_backward((torch.from_numpy(shard[:, :-1]), torch.from_numpy(shard[:, 1:])), backward)
        if rank == 0:
            save_file({"grads": _flat_grads(model).contiguous()}, f"{out}/grads.safetensors")
    finally:
        dist.destroy_process_group()


@claim(26, "Noam schedule peaks at step = warmup; cosine and linear schedules reach their endpoints",
       "000 §17.2, LLM §4.2, §10.1")
def schedules() -> Result:
    kw = dict(lr=1.0, min_lr=0.1, warmup=100, total=1000, d_model=512)
    noam = [SCHEDULES.get("noam")(s, **kw) for s in range(1000)]
    peak = max(range(1000), key=noam.__getitem__)
    measured = {"noam argmax s = step + 1": peak + 1,
                "noam peak vs d^-0.5 warmup^-0.5": [noam[peak], 512 ** -0.5 * 100 ** -0.5]}
    for name in ("cosine", "linear"):
        f = SCHEDULES.get(name)
        measured[f"{name} lr at step warmup, at the last step"] = [f(100, **kw), f(999, **kw)]
    ends = [measured[f"{name} lr at step warmup, at the last step"] for name in ("cosine", "linear")]
    ok = (peak + 1 == 100 and abs(noam[peak] - 512 ** -0.5 * 0.1) < 1e-12
          and all(abs(a - 1.0) < 1e-12 and abs(b - 0.1) < 1e-12 for a, b in ends))
    return Result(status(ok), measured, "qkv.schedules, warmup 100 of 1000 steps, lr 1, min_lr 0.1. Steps "
                  "count from 0 and s = step + 1, so the first update is not at lr 0 (docs/DEVIATIONS.md); the "
                  "decays end at min_lr on the last update (the notes decay to 0 at t_total).")


@claim(27, "Adam bias correction: the first updates have magnitude lr", "000 §17.1, LLM §4.1")
def adam_first_step() -> Result:
    lr, b1, b2, eps = 1e-3, 0.9, 0.999, 1e-8
    gen = torch.Generator().manual_seed(0)
    g = torch.randn(1000, generator=gen, dtype=F64) * 10 ** torch.empty(1000, dtype=F64).uniform_(
        -3, 3, generator=gen)  # gradients spanning six decades, the same at each of the first steps
    grads = [g, g, g]

    theta = torch.nn.Parameter(torch.zeros(1000, dtype=F64))
    holder = torch.nn.Module()
    holder.theta = theta
    tc = TrainConfig(optimizer="adam", lr=lr, beta1=b1, beta2=b2, eps=eps, weight_decay=0.0)
    opt = OPTIMIZERS.get("adam")(holder, tc)  # what train.optimizer="adam" builds
    ratios = []
    for g in grads:
        before = theta.detach().clone()
        theta.grad = g.clone()
        opt.step()
        ratios.append(((theta.detach() - before).abs() / lr).mean().item())
    # the same first step without the correction: m_1 = (1 - b1) g, v_1 = (1 - b2) g^2
    uncorrected = (lr * (1 - b1) * g / (((1 - b2) * g * g).sqrt() + eps)).abs().mean().item() / lr
    measured = {"mean |update| / lr, steps 1-3": ratios, "step 1 without bias correction": uncorrected}
    ok = all(abs(r - 1) < 0.01 for r in ratios) and abs(uncorrected - 0.1 / 0.001 ** 0.5) < 0.05
    return Result(status(ok), measured, "qkv.train.optim's adam (train.optimizer='adam'), one gradient repeated for 3 steps: "
                  "m^_t = g and v^_t = g^2, so |update| = lr |g| / (|g| + eps) = lr whatever the gradient's scale; "
                  "uncorrected, step 1 would be (1 - b1) / sqrt(1 - b2) = 3.16 lr.")


@claim(30, "fp32 / fp16 / bf16 ranges; fp16 needs loss scaling (gradients underflow), bf16 does not",
       "000 LLM §6.2; 003 (FP32、FP16、BF16)")
def precisions() -> Result:
    table = {name: {"max": torch.finfo(dt).max, "min_normal": torch.finfo(dt).tiny, "eps": torch.finfo(dt).eps}
             for name, dt in (("fp32", torch.float32), ("fp16", torch.float16), ("bf16", torch.bfloat16))}
    model, cfg = _tiny_model()
    ids = torch.randint(0, cfg.vocab_size, (8, 13), generator=torch.Generator().manual_seed(3))
    _grads(model, ids, scale=1e-3)  # a loss averaged over ~1000x more tokens: gradients 1000x smaller
    g = _flat_grads(model).float()
    g = g[g != 0]

    def flushed(dtype, scale=1.0):
        return float(((g * scale).to(dtype) == 0).float().mean())

    measured = {"formats": table, "nonzero fp32 gradients": int(g.numel()),
                "share flushed to 0 in fp16": flushed(torch.float16),
                "in fp16 with loss scale 2^16": flushed(torch.float16, 2.0 ** 16),
                "in bf16": flushed(torch.bfloat16)}
    ok = (measured["share flushed to 0 in fp16"] > 0.01 and measured["in bf16"] == 0
          and measured["in fp16 with loss scale 2^16"] < measured["share flushed to 0 in fp16"] / 10)
    return Result(status(ok), measured, "Real gradients of a small decoder, loss x 1e-3 (as a mean over 1000x more "
                  "tokens). fp16's smallest subnormal is 6e-8 and its normals stop at 6.1e-5: small gradients "
                  "vanish unless the loss is scaled up first; bf16 has fp32's exponent range (min normal 1.2e-38) "
                  "with an 8-bit mantissa, so it rounds but does not underflow.")
