"""DPO (qkv.train.dpo): the loss and its gradient against trl's implementation, the log-probability sums against
qkv eval's, and the command end to end."""
import json
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

import qkv
from qkv.config import ModelConfig
from qkv.data.sft import IGNORE
from qkv.models import build_model
from qkv.train import dpo
from tests.cli.test_main import cli
from tests.formats.gguf import write_llama

trl = pytest.importorskip("trl", reason="trl is a test dependency (pip install -e .[dev])")


def trl_loss(logits, input_ids, completion_mask, ref_chosen, ref_rejected, beta):
    """trl's DPOTrainer._compute_loss (loss_type sigmoid, precomputed reference log-probs) on fixed logits: a
    stand-in model returns the per-token log-probs of the given logits, as transformers' fused head would."""
    def model(**kwargs):
        labels = kwargs["labels"]
        logps = logits[:, :-1].log_softmax(-1).gather(-1, input_ids[:, 1:, None].clamp(min=0))[..., 0]
        logps = logps * (labels[:, 1:] != IGNORE)
        zeros = torch.zeros_like(logps)
        return SimpleNamespace(log_probs=logps, entropy=zeros, mean_logits=zeros, is_top1=zeros.bool())

    accelerator = SimpleNamespace(device=logits.device, gather_for_metrics=lambda t: t, gather=lambda t: t)
    stub = SimpleNamespace(model=SimpleNamespace(training=True), accelerator=accelerator, aux_loss_enabled=False,
                           ld_alpha=None, precompute_ref_logps=True, f_divergence_type="reverse_kl",
                           loss_types=["sigmoid"], loss_weights=[1.0], beta=beta, label_smoothing=0.0,
                           use_weighting=False, _metrics=defaultdict(lambda: defaultdict(list)),
                           _total_train_tokens=0, _tp_size=1)
    inputs = {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids),
              "completion_mask": completion_mask, "ref_chosen_logps": ref_chosen, "ref_rejected_logps": ref_rejected}
    return trl.DPOTrainer._compute_loss(stub, model, inputs, return_outputs=False)


def test_loss_and_gradient_equal_trls():
    torch.manual_seed(0)
    B, T, beta = 3, 10, 0.3
    cfg = ModelConfig(vocab_size=40, d_model=16, n_heads=4, n_layers=2, d_ff=32, max_seq_len=32, positional="rope")
    model = build_model(cfg)
    ids = torch.randint(0, 40, (B, 2, T))
    completion = torch.zeros(B, 2, T, dtype=torch.long)
    completion[:, :, 6:] = 1
    completion[1, 1, 8:] = 0  # a shorter rejected completion: the rest is padding
    targets = torch.full((B, 2, T), IGNORE)
    targets[..., :-1] = torch.where(completion[..., 1:] == 1, ids[..., 1:], IGNORE)
    documents = 1 - ((completion == 1) | (torch.arange(T) < 6)).long()  # padding: a document of its own
    reference = torch.randn(B, 2) - 8
    ours = dpo.loss(model, (ids, targets, documents, reference, torch.full((B,), beta)), 0.0)
    ours_grads = torch.autograd.grad(ours, list(model.parameters()), allow_unused=True)
    # trl's layout: all chosen rows, then all rejected; the same model's whole logits
    flat_ids = torch.cat([ids[:, 0], ids[:, 1]])
    flat_mask = torch.cat([completion[:, 0], completion[:, 1]])
    logits = model(flat_ids, documents=torch.cat([documents[:, 0], documents[:, 1]]))
    theirs = trl_loss(logits, flat_ids, flat_mask, reference[:, 0], reference[:, 1], beta)
    theirs_grads = torch.autograd.grad(theirs, list(model.parameters()), allow_unused=True)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
    for mine, other in zip(ours_grads, theirs_grads):
        if mine is not None or other is not None:
            torch.testing.assert_close(mine, other, rtol=1e-4, atol=1e-6)
    stats = dpo.RECORDER.take()
    margin = stats["reward_chosen"] - stats["reward_rejected"]
    torch.testing.assert_close(stats["reward_margin"], margin)


@torch.no_grad()
def continuation_logprob(model, context: list[int], continuation: list[int]) -> float:
    """sum log p(continuation | context) from the whole logits of one plain forward (qkv eval's sum)."""
    ids = torch.tensor([context + continuation])
    logits = model(ids[:, :-1])[0, -len(continuation):]
    return -F.cross_entropy(logits, torch.tensor(continuation), reduction="sum").item()


def test_the_log_probability_sums_equal_a_plain_forwards(tmp_path):
    path = write_llama(tmp_path / "tiny.gguf")
    run = qkv.load(path)
    rows = tmp_path / "pairs.jsonl"
    rows.write_text(json.dumps({"prompt": "sing of the", "chosen": " moon", "rejected": " silver sea"}) + "\n")
    pairs = dpo.read_pairs([str(rows)], run.tokenizer, run.chat)
    ours = dpo.reference_logps(run.model, pairs, 64, run.tokenizer.eos_id, "cpu")[0]
    for side, completion in enumerate((" moon", " silver sea")):
        context = run.tokenizer.encode("sing of the")
        expected = continuation_logprob(run.model, context, run.tokenizer.encode(completion) + [run.tokenizer.eos_id])
        assert ours[side] == pytest.approx(expected, rel=1e-5)


@pytest.fixture(scope="module")
def pairs_file(tmp_path_factory):
    root = tmp_path_factory.mktemp("dpo")
    rows = [{"prompt": f"line {i}", "chosen": " the moon", "rejected": " a silver sea"} for i in range(16)]
    (root / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return write_llama(root / "tiny.gguf"), root / "pairs.jsonl"


COMMON = ["--set", "train.seq_len=32", "--set", "train.batch_size=4", "--set", "train.precision=fp32",
          "--set", "train.threads=1", "--set", "train.lr=3e-3", "--set", "train.log_every=1", "--quiet", "--no-sample"]


@pytest.mark.parametrize("lora", [[], ["--lora", "r=4,alpha=8,dropout=0"]])
def test_dpo_prefers_the_chosen_and_resumes(pairs_file, tmp_path, capsys, lora):
    init, data = pairs_file
    out = tmp_path / "run"
    rc, stdout, err = cli(capsys, "train", "--task", "dpo", "--init", str(init), "--data", str(data), "--out", str(out),
                          "--max-steps", "8", "--set", "train.checkpoint_every=4", *lora, *COMMON, "--json")
    assert rc == 0, err
    rows = [line.split(",") for line in (out / "metrics.csv").read_text().splitlines()]
    header, first, last = rows[0], rows[1], rows[-2]
    at = {name: header.index(name) for name in ("loss", "reward_margin", "reward_accuracy")}
    assert float(first[at["loss"]]) == pytest.approx(0.693147, abs=1e-4)  # step 1: the policy is the reference
    assert float(last[at["reward_margin"]]) > 0.1 and float(last[at["reward_accuracy"]]) == 1.0
    summary = json.loads(stdout)
    assert summary["val_reward_accuracy"] == 1.0 and summary["val_reward_margin"] > 0.1
    rc, _, err = cli(capsys, "train", "--out", str(out), "--resume", "--max-steps", "9", "--quiet", "--no-sample")
    assert rc == 0 and "resuming from the checkpoint at step 8" in err, err
    (out / dpo.REFERENCE_FILE).unlink()
    rc, _, err = cli(capsys, "train", "--out", str(out), "--resume", "--max-steps", "10", "--quiet", "--no-sample")
    assert rc == 2 and "dpo_reference.safetensors: missing" in err, err


@pytest.mark.parametrize("row, message", [
    ({"prompt": "a", "chosen": "b"}, "expected {\"prompt\", \"chosen\", \"rejected\"}"),
    ({"prompt": "a", "chosen": " b", "rejected": " b"}, "chosen and rejected are the same"),
])
def test_a_bad_pair_is_named(pairs_file, tmp_path, capsys, row, message):
    init, _ = pairs_file
    data = tmp_path / "pairs.jsonl"
    data.write_text(json.dumps(row) + "\n")
    rc, _, err = cli(capsys, "train", "--task", "dpo", "--init", str(init), "--data", str(data), "--out",
                     str(tmp_path / "run"), "--max-steps", "1", "--quiet")
    assert rc == 2 and "pairs.jsonl:1: " in err and message in err, err


def test_options_that_do_not_apply_are_refused(pairs_file, tmp_path, capsys):
    init, data = pairs_file
    rc, _, err = cli(capsys, "train", "--task", "sft", "--init", str(init), "--data", str(data), "--set",
                     "train.dpo_beta=0.5", "--out", str(tmp_path / "a"), "--max-steps", "1")
    assert rc == 2 and "train.dpo_beta=0.5 applies to train.objective='dpo'" in err, err
    rc, _, err = cli(capsys, "train", "--task", "dpo", "--init", str(init), "--data", str(data), "--set",
                     "train.label_smoothing=0.1", "--out", str(tmp_path / "b"), "--max-steps", "1")
    assert rc == 2 and "train.label_smoothing=0.1" in err, err
    rc, _, err = cli(capsys, "train", "--task", "dpo", "--init", str(init), "--data", str(data), "--set",
                     "parallel.tp=2", "--out", str(tmp_path / "c"), "--max-steps", "1")
    assert rc == 2 and "data-parallel layouts" in err, err
