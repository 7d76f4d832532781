"""Expert parallel through the real CLI: `torchrun -m qkv train --set parallel.ep=2 ...` (gloo, CPU) against the
same MoE run in one process (qkv.parallel.experts): the loss curve, gradient norms (clipping active), the final
validation loss and the gathered checkpoint within 1e-5 relative, beside DDP (zero 0), beside FSDP2 (zero 3)
with two copies of each expert (dp 4, ep 2), and from a one-process checkpoint resumed under ep. The run routes
as DeepSeek-V3 does (sigmoid scores, a choosing bias moved by the load, router z-loss), which data parallel
reproduces exactly; the balance loss is each rank's own batch's, as under plain data parallel (docs/distributed.md).
The layer itself: tests/parallel/test_experts.py."""
from __future__ import annotations

from pathlib import Path

import pytest

from qkv.cli import main
from qkv.errors import QkvError
from qkv.files import read_tensors
from qkv.parallel import layout as parallel
from qkv.presets import get as preset
from qkv.train import checks
from tests.train.test_layouts import args, assert_same_run, launch

STEPS = 12
MOE = ["model.moe_experts=4", "model.moe_top_k=2", "model.moe_scoring=sigmoid", "model.moe_choice_bias=true",
       "train.moe_bias_rate=0.01", "train.router_z_loss_weight=0.001", "train.aux_loss_weight=0"]


@pytest.fixture(scope="module")
def single(text, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("experts") / "single"
    assert main(args(text, out, *MOE)) == 0
    return out


@pytest.mark.parametrize("processes, sets", [
    (2, ["parallel.dp=2", "parallel.ep=2"]),
    (4, ["parallel.dp=4", "parallel.ep=2", "parallel.zero=3"]),
], ids=["dp2_ep2", "dp4_ep2_zero3"])
def test_expert_parallel_equals_one_process(processes, sets, text, single, tmp_path):
    launch(processes, args(text, tmp_path / "run", *MOE, *sets))
    assert_same_run(tmp_path / "run", single)
    bias = read_tensors(single / "model.safetensors")["blocks.0.ffn.router_bias"]
    assert float(bias.abs().max()) > 0  # the load moved the choosing bias: the comparison covers it


def test_a_checkpoint_moves_into_expert_parallel(text, single, tmp_path):
    """6 steps in one process, resumed under dp=2 x ep=2 with zero=2 to 12: the run of 12 uninterrupted steps
    (each rank kept its experts' weights and moments from the file; the saved set is one process's again)."""
    assert main(args(text, tmp_path / "run", *MOE) + ["--max-steps", str(STEPS // 2)]) == 0
    ep = ["parallel.dp=2", "parallel.ep=2", "parallel.zero=2"]
    launch(2, ["train", "--out", str(tmp_path / "run"), "--resume", "--quiet", "--no-sample", "--max-steps",
               str(STEPS), *[item for s in ep for item in ("--set", s)]])
    assert_same_run(tmp_path / "run", single)


@pytest.mark.parametrize("sets, message", [
    (["parallel.ep=4", "model.moe_experts=2"], "parallel.ep=4 is more ranks than model.moe_experts=2"),
    (["parallel.ep=2", "model.moe_experts=3"], "parallel.ep=2 must divide model.moe_experts=3"),
    (["parallel.ep=2", "model.moe_experts=0"], "the model has none (model.moe_experts=0)"),
    (["parallel.dp=3", "parallel.ep=2", "model.moe_experts=4", "train.batch_size=12"], "parallel.ep=2 must divide parallel.dp=3"),
    (["parallel.dp=2", "parallel.ep=2", "parallel.zero=1", "model.moe_experts=4"], "use parallel.zero=0, 2 or 3"),
    (["parallel.dp=2", "parallel.ep=2", "parallel.pp=2", "model.moe_experts=4", "parallel.microbatches=2"],
     "runs beside data parallel only"),
    (["parallel.dp=2", "parallel.ep=2", "train.precision=fp16", "model.moe_experts=4"], "use bf16 or fp32"),
])
def test_impossible_expert_layouts_are_refused_in_one_line(sets, message):
    """Checked before any process group exists (qkv.parallel.layout.check_layout, as `qkv train` asks it)."""
    cfg = preset("tiny").override(sets)
    world = cfg.parallel.dp * cfg.parallel.tp * cfg.parallel.pp
    with pytest.raises(QkvError, match=message.replace("(", r"\(").replace(")", r"\)")):
        parallel.check_layout(cfg, world)


@pytest.mark.parametrize("sets, message", [
    (["train.lora=r=4", "train.init=base"], "tensor, pipeline and expert parallel split the layers it wraps"),
    (["train.objective=dpo", "train.init=base"], "without parallel.ep"),
])
def test_adaptations_expert_parallel_cannot_run_are_refused(sets, message):
    """LoRA wraps the experts' layers that expert parallel splits; DPO's reference model keeps every expert."""
    cfg = preset("tiny").override(["parallel.dp=2", "parallel.ep=2", "model.moe_experts=4", *sets])
    with pytest.raises(QkvError, match=message):
        checks.check_lora(cfg)
