"""Pipeline parallel (qkv.parallel.pipeline; note 000 LLM §7.2, SPEC C4) on 2 gloo processes against one
process: the same losses over 10 AdamW steps (one case with 2-step accumulation), the same first gradients,
each rank holding only its stage's parameters and moments, and the whole model and optimizer state gathered
on rank 0 equal to one process's (fp32, dropout 0); mis-sized layouts exit 2."""
import dataclasses
import re

import pytest
import torch

from qkv.train.checks import check_run
from qkv.config import ModelConfig, ParallelConfig, RunConfig, TrainConfig
from qkv.errors import QkvError
from qkv.models import build_model
from qkv.analysis import params
from qkv.parallel import layout as parallel
from qkv.parallel import pipeline
from tests.train.model_parallel_worker import CASES, results

PP_CASES = [name for name, case in CASES.items() if case["mode"] == "pp"]


def close(errors: dict, rtol: float, atol_share: float) -> list:
    """The entries with ||got - want|| > rtol ||want|| + atol_share ||all of want||."""
    total = sum(norm ** 2 for _, norm in errors.values()) ** 0.5
    return [(name, error, norm) for name, (error, norm) in errors.items() if error > rtol * norm + atol_share * total]


@pytest.mark.parametrize("name", PP_CASES)
def test_losses_gradients_and_gathered_state_equal_one_process(name):
    by_rank = results()
    stage_params = [set(by_case[name]["grad_errors"]) for by_case in by_rank.values()]
    assert set.union(*stage_params) == set(by_rank[0][name]["reference_names"])  # each stage its share
    for rank, by_case in by_rank.items():
        result = by_case[name]
        assert len(result["losses"]) == 10
        for got, want in zip(result["losses"], result["reference"]):
            assert got == pytest.approx(want, rel=1e-5), (rank, result["losses"], result["reference"])
        # gradients of this rank's stage (the key bias's is 0 in exact arithmetic: an atol)
        assert close(result["grad_errors"], 1e-5, 1e-6) == []
    # rank 0 gathered every weight and moment from the stages; after 10 Adam steps rounding differences
    # have grown through 1/sqrt(v): 1e-4
    synced = by_rank[0][name]["synced"]
    assert len(synced) == 2 * len(by_rank[0][name]["reference_names"])
    assert close(synced, 1e-4, 1e-6) == []
    assert by_rank[1][name]["synced"] == {}


@pytest.mark.parametrize("name", PP_CASES)
def test_each_rank_holds_only_its_stage(name):
    """The memory split: a rank's real (non-meta) parameters are exactly its stage's, and only they have
    Adam moments; the stages together hold every parameter."""
    by_rank = results()
    for rank, by_case in by_rank.items():
        result = by_case[name]
        held = {param for param, real in result["resident"].items() if real}
        assert held == set(result["grad_errors"]), rank
        assert set(result["moments"]) == held, rank
        assert len(held) < len(result["resident"]), rank  # something was released
    assert set.union(*({p for p, real in by_case[name]["resident"].items() if real}
                       for by_case in by_rank.values())) == set(by_rank[0][name]["reference_names"])


@pytest.mark.parametrize("positional", ["learned", "shaw"])
def test_stages_chained_in_one_process_equal_the_model(tiny_cfg, positional):
    """Stage 0 -> stage 1 -> stage 2 is the decoder's forward: same logits, and a learned table is
    a parameter of the first stage only (later stages take the identity hooks)."""
    model = build_model(dataclasses.replace(tiny_cfg, n_layers=3, positional=positional, attention="naive"))
    stages = [pipeline.Stage(model, layers, first=s == 0, last=s == 2, tokens=7)
              for s, layers in enumerate(params.stage_layers(3, 3))]
    ids = torch.randint(tiny_cfg.vocab_size, (2, 7))
    x = ids
    for stage in stages:
        x = stage(x)
    torch.testing.assert_close(x, model(ids), rtol=1e-6, atol=1e-6)
    table = model.positional.key_table.weight if positional == "shaw" else model.positional.weight
    holders = [any(p is table for p in stage.parameters()) for stage in stages]
    assert holders == ([True, True, True] if positional == "shaw" else [True, False, False])


def test_stage_split():
    assert params.stage_layers(3, 2) == [range(0, 2), range(2, 3)]
    assert params.stage_layers(5, 3) == [range(0, 2), range(2, 3), range(3, 5)]
    assert [len(r) for r in params.stage_layers(12, 4)] == [3, 3, 3, 3]


def test_layouts_that_cannot_run_are_refused():
    base = RunConfig(model=ModelConfig(n_layers=2), train=TrainConfig(batch_size=8))
    pipeline.validate(base.override(["parallel.pp=2"]))
    cases = ((["parallel.pp=3"], "parallel.pp=3 is larger than model.n_layers=2"),
             (["parallel.pp=2", "parallel.microbatches=3"], "parallel.microbatches=3 must be at least"),
             (["parallel.pp=2", "parallel.microbatches=1"], "parallel.microbatches=1 must be at least parallel.pp=2"),
             (["parallel.pp=2", "train.accumulation=4", "parallel.microbatches=4"], "divide the 2 rows"),
             (["parallel.pp=2", "train.batch_warmup_steps=5"], "train.batch_warmup_steps=5"),
             (["parallel.pp=2", "train.seq_warmup_steps=5"], "train.seq_warmup_steps=5"),
             (["parallel.pp=2", "parallel.zero=1"], "parallel.zero=1: shard a pipeline"),
             (["parallel.pp=2", "model.arch=encoder"], "decoder LM only"))
    for assignments, message in cases:
        with pytest.raises(QkvError, match=re.escape(message)):
            pipeline.validate(base.override(assignments))
    with pytest.raises(QkvError, match="parallel.schedule"):
        check_run(RunConfig(parallel=ParallelConfig(schedule="zb")))


def test_the_launch_checks_the_layout_before_any_process_group():
    cfg = RunConfig(model=ModelConfig(n_layers=2)).override(["parallel.pp=4"])
    with pytest.raises(QkvError, match="parallel.pp=4 is larger than model.n_layers=2"):
        parallel.check_layout(cfg, world=4)
