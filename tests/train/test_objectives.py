"""Training objectives (SPEC B1, B10): the registry, the lm path is the decoder's old path bit for bit, every
preset trains at reduced size through its objective, and `qkv train` runs MLM and seq2seq end to end (the loss
falls; a resume is exact; eval and generate refuse non-decoder runs with exit 2)."""
import dataclasses

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from qkv import presets
from qkv.cli import main
from qkv.train.checks import check_run
from qkv.config import RunConfig, TrainConfig
from qkv.data.tokenizer import MASK, PAD, Tokenizer
from qkv.errors import QkvError
from qkv.models import build_model
from qkv.formats import load
from qkv.models.build import objective_of
from qkv.train import objectives
from qkv.files import MODEL_FILE, read_tensors
from qkv.evaluate.tokens import val_loss
from qkv.train.metrics import MetricsLog
from qkv.train.objectives import OBJECTIVES
from tests.train import setup_env, verse

SMALL = dict(d_model=32, n_heads=4, n_layers=2, d_ff=64, max_seq_len=64, dropout=0.0)
FAMILIES = ["bert-base", "t5-small", "vaswani-base"]


def reduced(name: str, vocab_size: int):
    cfg = presets.get(name)
    model = dataclasses.replace(cfg.model, **SMALL, vocab_size=vocab_size,
                                n_kv_heads=min(cfg.model.n_kv_heads, 2), n_encoder_layers=0, n_decoder_layers=0)
    train = dataclasses.replace(cfg.train, batch_size=4, seq_len=32)
    return dataclasses.replace(cfg, model=model, train=train)


def test_registry_and_the_architectures_own_objectives():
    assert {"lm", "mlm", "seq2seq", "classify"} <= set(OBJECTIVES.names())
    for arch, head, name in (("decoder", "none", "lm"), ("encoder", "mlm", "mlm"),
                             ("encoder-decoder", "none", "seq2seq")):
        cfg = presets.get("tiny")
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, arch=arch, head=head))
        assert objective_of(cfg) == name and objectives.for_run(cfg) is OBJECTIVES.get(name)


@pytest.mark.parametrize("model, objective, message", [
    (dict(arch="encoder"), "auto", "train.objective='mlm' trains model.arch='encoder' with model.head='mlm'; "
                                   "this run has model.arch='encoder', model.head='none'"),
    ({}, "seq2seq", "train.objective='seq2seq' trains model.arch='encoder-decoder'"),
])
def test_an_objective_the_model_cannot_train_is_an_error(model, objective, message):
    cfg = presets.get("tiny")
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, **model),
                              train=dataclasses.replace(cfg.train, objective=objective))
    with pytest.raises(QkvError, match=message):
        objectives.for_run(cfg)


def test_train_objective_and_mask_prob_are_validated():
    with pytest.raises(QkvError, match="train.objective='clm' is not allowed; choose from: auto, classify, dpo, lm, mlm, seq2seq, sft"):
        check_run(RunConfig(train=TrainConfig(objective="clm")))
    with pytest.raises(QkvError, match=r"train.mask_prob=1.0 must be in \(0, 1\)"):
        TrainConfig(mask_prob=1.0).validate()


def test_lm_loss_and_evaluation_are_the_decoder_path():
    """The LM loss takes the head and the loss in chunks (qkv.nn.linear_cross_entropy): equal to float rounding."""
    cfg = presets.get("tiny")
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, vocab_size=64))
    model = build_model(cfg.model)
    stream = (np.arange(2000) * 7 % 64).astype(np.uint16)
    lm = OBJECTIVES.get("lm")
    x, y = (torch.from_numpy(a) for a in lm.batches(stream, None, cfg, batch_size=4, seed=2).next())
    expected = F.cross_entropy(model(x).flatten(0, 1).float(), y.flatten(), label_smoothing=0.1)
    torch.testing.assert_close(lm.loss(model, (x, y), 0.1), expected, rtol=1e-6, atol=1e-6)
    got = objectives.evaluate(lm, model, stream, None, cfg, batch_size=3, batches=2, seed=5, device="cpu")
    want = val_loss(model, stream, seq_len=cfg.train.seq_len, batch_size=3, batches=2, seed=5, device="cpu")
    assert got == pytest.approx(want, rel=1e-6)


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    tok = Tokenizer.train([verse()], 300)
    tok.add_specials([MASK, PAD])
    return tok


@pytest.mark.parametrize("name", presets.PRESETS.names())
def test_every_preset_trains_through_its_objective_at_reduced_size(name, tokenizer, monkeypatch, tmp_path):
    """Build at reduced size, draw one batch of the preset's objective from real text, backward: every
    parameter gets a finite gradient; the initial loss is near ln V (a uniform guess)."""
    monkeypatch.setenv("QKV_CACHE", str(tmp_path))
    cfg = reduced(name, tokenizer.vocab_size)
    objective = objectives.for_run(cfg)
    text = verse()
    if cfg.data.seq2seq_task == "folio":  # pairs "source<TAB>target" on each line
        text = "\n".join(f"{line}\t{line.lower()}" for line in text.splitlines())
    stream = np.array([tokenizer.eos_id] + tokenizer.encode(text))
    batch = [torch.from_numpy(a) for a in objective.batches(stream, tokenizer, cfg, batch_size=4, seed=0).next()]
    model = build_model(cfg.model)
    loss = objective.loss(model, batch, 0.0)
    loss.backward()
    assert abs(loss.item() - np.log(tokenizer.vocab_size)) < 1.0
    for param_name, param in model.named_parameters():
        assert param.grad is not None and torch.isfinite(param.grad).all(), param_name


# ---- qkv train end to end -----------------------------------------------------------------------------------
@pytest.fixture
def text(monkeypatch, tmp_path_factory):
    return setup_env(monkeypatch, tmp_path_factory)


def train(text, out, preset, steps, *extra):
    sizes = [f"model.{k}={v}" for k, v in SMALL.items()] + [
        "train.batch_size=8", "train.seq_len=32", "train.warmup_steps=5", "train.threads=1", "train.device=cpu",
        "train.eval_batches=2", "train.log_every=1", "data.vocab_size=280"]
    argv = ["train", "--preset", preset, "--data", str(text), "--out", str(out), "--quiet", "--json",
            "--max-steps", str(steps), *[arg for pair in sizes for arg in ("--set", pair)], *extra]
    return main(argv)


def losses(run) -> list[float]:
    return [float(row["loss"]) for row in MetricsLog.read(run / "metrics.csv") if row["loss"]]


@pytest.mark.parametrize("preset, special", [("bert-base", MASK), ("t5-small", PAD), ("vaswani-base", PAD)])
def test_qkv_train_runs_every_family_and_eval_generate_handle_it(preset, special, text, tmp_path, capsys):
    run = tmp_path / preset
    assert train(text, run, preset, 3) == 0, capsys.readouterr().err
    summary = capsys.readouterr().out
    assert '"steps": 3' in summary and '"val_bits_per_char": null' in summary
    loaded = load(run)
    assert loaded.tokenizer.special_id(special) == loaded.config.model.vocab_size - 1  # appended last
    assert main(["eval", str(run), "--json"]) == 0, capsys.readouterr().err  # each objective's own evaluator
    capsys.readouterr()
    generated = main(["generate", str(run), "--prompt", "moon", "--max-new-tokens", "4", "--beams", "2"])
    if special == MASK:  # an MLM encoder does not generate
        assert generated == 2 and "qkv generate supports lm and seq2seq runs" in capsys.readouterr().err
    else:  # an encoder-decoder writes a target for the prompt as its source, by beam search by default
        assert generated == 0, capsys.readouterr().err


@pytest.mark.parametrize("preset", FAMILIES)
def test_loss_decreases_over_twenty_steps(preset, text, tmp_path, capsys):
    """MLM (bert-base) and seq2seq next-line (t5-small, and vaswani-base with the paper's Noam schedule)."""
    extra = [] if preset == "vaswani-base" else ["--set", "train.lr=3e-3"]
    assert train(text, tmp_path / "run", preset, 20, *extra) == 0, capsys.readouterr().err
    curve = losses(tmp_path / "run")
    assert len(curve) == 20 and np.mean(curve[-4:]) < np.mean(curve[:2]) - 0.5, curve


@pytest.mark.parametrize("preset", ["bert-base", "vaswani-base"])
def test_resume_is_exact(preset, text, tmp_path, capsys):
    """3 steps, then --resume to 6 == 6 steps straight: the MLM / seq2seq sampler state is restored."""
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    assert train(text, straight, preset, 6) == 0
    assert train(text, resumed, preset, 3) == 0
    assert main(["train", "--out", str(resumed), "--resume", "--max-steps", "6", "--quiet", "--json"]) == 0
    capsys.readouterr()
    a, b = read_tensors(straight / MODEL_FILE), read_tensors(resumed / MODEL_FILE)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert losses(straight) == losses(resumed)
