"""Tensor + sequence parallel (qkv.parallel.tensor; note 000 LLM §7.2, SPEC C3) on 2 gloo processes
against one process: the same losses over 10 AdamW steps and the same first gradients (fp32, dropout 0),
through the training step's vocabulary-parallel loss; mis-sized layouts exit 2."""
import re

import pytest

from qkv.config import ModelConfig, RunConfig
from qkv.errors import QkvError
from qkv.parallel import layout as parallel
from qkv.parallel import tensor as tensor_parallel
from tests.train.model_parallel_worker import CASES, results

TP_CASES = [name for name, case in CASES.items() if case["mode"] == "tp"]


@pytest.mark.parametrize("name", TP_CASES)
def test_losses_and_gradients_equal_one_process(name):
    for rank, by_case in results().items():
        result = by_case[name]
        assert len(result["losses"]) == 10
        for got, want in zip(result["losses"], result["reference"]):
            assert got == pytest.approx(want, rel=1e-5), (rank, result["losses"], result["reference"])
        assert set(result["grad_errors"]) == set(result["reference_names"])  # every parameter, gathered
        total = sum(norm ** 2 for _, norm in result["grad_errors"].values()) ** 0.5
        for param, (error, norm) in result["grad_errors"].items():
            # the key bias's gradient is 0 in exact arithmetic: an atol relative to the whole gradient
            assert error <= 1e-5 * norm + 1e-6 * total, (rank, param, error, norm)


def test_each_rank_holds_its_slice_of_the_logits():
    """The head's logits stay split over the vocabulary for the vocabulary-parallel loss: V/2 per rank."""
    for by_case in results().values():
        for name in TP_CASES:
            assert by_case[name]["logit_width"] == CASES[name]["model"]["vocab_size"] // 2, name


def test_layouts_that_do_not_divide_are_refused():
    cfg = ModelConfig(n_heads=4, n_kv_heads=2, d_ff=64, vocab_size=64)
    tensor_parallel.validate(cfg, 2)  # H=4, Hkv=2, F=64 split in two
    tensor_parallel.validate(ModelConfig(vocab_size=65), 2)  # V need not divide: DTensor shards unevenly
    cases = ((cfg, 3, "parallel.tp=3 must divide model.n_heads=4"),
             (cfg, 4, "parallel.tp=4 must divide model.n_kv_heads=2"),
             (ModelConfig(n_heads=4, d_ff=66, vocab_size=64), 4, "parallel.tp=4 must divide model.d_ff=66"),
             (ModelConfig(moe_experts=4), 2, "mixture-of-experts"),
             (ModelConfig(positional="rope", head_size=8, mla_kv_rank=16, mla_rope_dims=4), 2, "latent attention"),
             (ModelConfig(arch="encoder-decoder"), 2, "model.arch='decoder' only"),
             (ModelConfig(positional="t5"), 2, "model.positional='t5'"))
    for model, tp, message in cases:
        with pytest.raises(QkvError, match=re.escape(message)):
            tensor_parallel.validate(model, tp)


def test_the_launch_checks_the_model_before_any_process_group():
    """`torchrun --nproc-per-node 2 -m qkv train --set parallel.tp=2` with 3 heads: a QkvError (exit 2)
    from the layout check that runs before the process group is joined."""
    cfg = RunConfig(model=ModelConfig(n_heads=3, d_model=48, d_ff=96)).override(["parallel.tp=2"])
    with pytest.raises(QkvError, match="parallel.tp=2 must divide model.n_heads=3"):
        parallel.check_layout(cfg, world=2)
