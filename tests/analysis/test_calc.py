"""`qkv calc`'s setup from a run's config (qkv.analysis.calc): the micro-batch each GPU runs, the refusals
of options that do not apply, and MFU over the tokens of one optimizer step."""
import pytest

from qkv import presets
from qkv.analysis import calc, flops
from qkv.errors import QkvError


def test_the_micro_batch_divides_the_batch_by_accumulation_dp_and_pipeline_micro_batches():
    cfg = presets.get("tiny").override(["train.batch_size=32", "train.accumulation=2", "parallel.dp=2",
                                        "parallel.pp=2", "parallel.microbatches=4"])
    setup = calc.setup_from(cfg)
    assert (setup.batch, setup.gpus, setup.microbatches, setup.accumulation) == (2, 2, 4, 2)
    assert calc.setup_from(presets.get("tiny").override(["train.batch_size=32", "parallel.dp=2"])).batch == 16
    assert calc.setup_from(cfg, batch=3).batch == 3  # given on the command line: as given


@pytest.mark.parametrize("option", ["microbatches", "schedule"])
def test_pipeline_options_without_a_pipeline_are_refused(option):
    with pytest.raises(QkvError, match="--pp > 1"):
        calc.setup_from(presets.get("tiny"), **{option: 4 if option == "microbatches" else "gpipe"})


@pytest.mark.parametrize("sets, given", [([], {}), (["model.moe_experts=3"], {}), (["model.moe_experts=4"], {"gpus": 3})])
def test_expert_parallel_that_cannot_split_the_experts_is_refused(sets, given):
    """--ep without experts, not dividing them, or not dividing the data-parallel GPUs."""
    cfg = presets.get("tiny").override(sets + ["parallel.dp=2"])
    with pytest.raises(QkvError, match="--ep=2 splits each MoE layer's experts"):
        calc.calculate(cfg, ep=2, **given)


def test_expert_parallel_takes_the_runs_setting():
    cfg = presets.get("tiny").override(["model.moe_experts=4", "parallel.dp=4", "parallel.ep=2"])
    assert calc.setup_from(cfg).ep == 2 and calc.setup_from(cfg, ep=4).ep == 4


def test_mfu_counts_every_token_of_an_optimizer_step():
    """32 sequences per step however they are split (dp 2 x accumulation 2 x 4 micro-batches of 2): MFU =
    6N-with-attention FLOPs per token x 32 x 32 tokens / step time / (peak x 2 GPUs)."""
    cfg = presets.get("tiny").override(["train.batch_size=32", "train.accumulation=2", "parallel.dp=2",
                                        "parallel.pp=2", "parallel.microbatches=4"])
    result = calc.calculate(cfg, step_time=0.5, peak_flops=1e12)
    model = calc.trained_model(cfg)
    assert result["mfu"]["tokens_per_step"] == 32 * 32
    want = flops.train_flops_per_token(model, 32) * 32 * 32 / 0.5 / 2e12
    assert result["mfu"]["mfu"] == pytest.approx(want, rel=1e-12)


def test_the_trained_model_has_the_tokenizer_vocabulary():
    """A new run trains a tokenizer of data.vocab_size tokens: the calculators count that vocabulary."""
    cfg = presets.get("tiny").override(["data.vocab_size=1000", "model.vocab_size=300"])
    assert calc.trained_model(cfg).vocab_size == 1000


def test_the_calculators_schedules_are_the_pipelines():
    """qkv calc's in-flight rule per schedule names exactly the schedules qkv.parallel.pipeline runs."""
    from qkv.analysis.memory import IN_FLIGHT
    from qkv.parallel.pipeline import PIPELINE_SCHEDULES

    assert sorted(IN_FLIGHT) == sorted(PIPELINE_SCHEDULES.names())
    assert [IN_FLIGHT["1f1b"](8, 4, s) for s in range(4)] == [4, 3, 2, 1] and IN_FLIGHT["gpipe"](8, 4, 3) == 8


def test_tensor_parallel_logits_are_split_unless_label_smoothing_gathers_them():
    """head_cross_entropy's vocabulary-parallel loss holds V/tp of the fp32 log-probabilities and their
    gradient per rank; with label smoothing it gathers the whole (B, T, V) (torch's loss_parallel has none):
    the calculator's difference is 2 x 4 B T V (1 - 1/tp) bytes."""
    from qkv.analysis import memory

    cfg = presets.get("tiny").override(["train.batch_size=16", "train.seq_len=64", "parallel.tp=2"])
    smoothed = cfg.override(["train.label_smoothing=0.1"])
    split, whole = (calc.setup_from(c) for c in (cfg, smoothed))
    assert split.split_logits and not whole.split_logits
    extra = memory.training(cfg.model, whole)["total"] - memory.training(cfg.model, split)["total"]
    assert extra == 2 * 4 * 16 * 64 * cfg.model.vocab_size * (1 - 1 / 2)
