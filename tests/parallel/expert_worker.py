"""One rank of tests/parallel/test_experts.py: an MoE layer under expert parallel (qkv.parallel.experts) against
the same layer in this process on the whole batch.

Each rank builds the same layer (seeded), takes batch rows rank::2 and runs the layer with its experts split
over the 2 ranks, then backward of L_k = sum(out_k * probe_k). The oracle, in the same process: the whole
layer called on each rank's rows (capacity counts per call, as under data parallel), backward of sum_k L_k.
Compared: this rank's outputs and input gradients, its own experts' gradients (which receive every rank's
share through the all-to-all's backward), and the router's and shared expert's gradients summed over the ranks. Writes OUT/rank{r}.json with the largest differences of every case.
Usage (ranks started by the test): RANK=r WORLD_SIZE=2 <store_env> python tests/parallel/expert_worker.py OUT
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist

from qkv.nn.moe import MoE, Routing
from qkv.parallel import experts

EXPERTS, D, F = 4, 16, 24
CASES = {
    "softmax_top2": {"top_k": 2},
    "sigmoid_top1_shared": {"top_k": 1, "routing": Routing(scoring="sigmoid", scale=2.5), "shared_d_ff": 8},
    "capacity": {"top_k": 2, "capacity_factor": 0.5},  # routes dropped: some tokens reach no expert
    "one_rank_idle": {"top_k": 2, "bias": [9.0, 9.0, 0.0, 0.0]},  # every route to rank 0's experts
    "one_rank_busy": {"top_k": 1, "bias": [0.0, 0.0, 0.0, 9.0]},  # all to expert 3: rank 0 receives nothing
}


def layer(case: dict) -> MoE:
    torch.manual_seed(0)
    moe = MoE(D, F, experts=EXPERTS, top_k=case["top_k"], capacity_factor=case.get("capacity_factor", 0.0),
              ffn="glu", activation="silu", bias=False, routing=case.get("routing", Routing()),
              choice_bias="bias" in case, shared_d_ff=case.get("shared_d_ff", 0)).double()
    if "bias" in case:
        moe.router_bias.copy_(torch.tensor(case["bias"]))
    return moe


def largest(a: torch.Tensor | None, b: torch.Tensor | None) -> float:
    if a is None or b is None:
        return 0.0 if a is None and b is None else float("inf")  # a gradient one side has and the other not
    return float((a - b).abs().max()) if a.numel() else 0.0


def run(case: dict, rank: int, group) -> dict:
    torch.manual_seed(1)
    x = torch.randn(4, 6, D, dtype=torch.float64)
    probe = torch.randn(4, 6, D, dtype=torch.float64)
    oracle = layer(case)
    whole = x.clone().requires_grad_()
    outs = [oracle(whole[k::2]) for k in range(2)]  # a call per rank's rows: capacity counts per call
    sum((out * probe[k::2]).sum() for k, out in enumerate(outs)).backward()

    moe = layer(case)
    layout = SimpleNamespace(ep=2, ep_rank=rank, ep_group=group)
    owner = experts.apply(moe, layout)
    mine = x[rank::2].clone().requires_grad_()
    got = moe(mine)
    (got * probe[rank::2]).sum().backward()
    names = dict(oracle.named_parameters())
    replicated = {}  # the router's and shared expert's gradients: each rank's share, summed (as data parallel does)
    for name, param in moe.named_parameters():
        if name not in owner:
            dist.all_reduce(param.grad)
            replicated[name] = largest(param.grad, names[name].grad)
    return {
        "output": largest(got.detach(), outs[rank].detach()),
        "input_grad": largest(mine.grad, whole.grad[rank::2]),
        "router_grad": replicated.pop("router.weight"),
        "expert_grads": max(largest(p.grad, names[n].grad) for n, p in moe.named_parameters()
                            if n in owner and not p.is_meta),
        "shared_grads": max(replicated.values(), default=0.0),
        "meta": sorted(n for n, p in moe.named_parameters() if p.is_meta),
        "idle": sorted(n for n, p in moe.named_parameters() if n in owner and not p.is_meta and p.grad is None),
        "oracle_idle": sorted(n for n, p in oracle.named_parameters() if n in owner and p.grad is None),
    }


def main(out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    group = dist.new_group([0, 1])
    results = {name: run(case, rank, group) for name, case in CASES.items()}
    (Path(out) / f"rank{rank}.json").write_text(json.dumps(results))
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.path.insert(0, os.getcwd())
    main(sys.argv[1])
