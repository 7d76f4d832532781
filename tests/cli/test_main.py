"""`qkv` end to end on the tiny preset: train, resume, eval, generate, presets, and every bad input's
exit 2 with one `qkv: error:` line. In-process through qkv.cli.main (fast); one subprocess test proves
`python -m qkv` works and that a SIGKILL mid-training leaves a run whose resumed losses are exact."""
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import qkv
from qkv.cli import main
from qkv.files import MODEL_FILE, read_tensors
from qkv.train.metrics import COLUMNS, MetricsLog
from tests.train import TINY, setup_env, trained_run

SRC = Path(qkv.__file__).resolve().parents[1]  # the qkv these tests import, for the subprocess too


@pytest.fixture(autouse=True)
def text(monkeypatch, tmp_path_factory) -> Path:
    return setup_env(monkeypatch, tmp_path_factory)


@pytest.fixture
def run(tmp_path_factory) -> Path:
    return trained_run(tmp_path_factory)[0]


def cli(capsys, *argv) -> tuple[int, str, str]:
    rc = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def train(capsys, text, out, *extra):
    return cli(capsys, "train", *TINY, "--data", text, "--out", out, "--set", "train.log_every=1", *extra)


def loss_rows(run_dir: Path) -> list[tuple[str, str, str]]:
    return [(r["step"], r["loss"], r["lr"]) for r in MetricsLog.read(run_dir / "metrics.csv") if r["loss"]]


def same_weights(a: Path, b: Path) -> bool:
    ta, tb = read_tensors(a / MODEL_FILE), read_tensors(b / MODEL_FILE)
    return ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) for k in ta)


# ---- train / eval / generate / presets ------------------------------------------------------------
def test_train_prints_summary_and_sample_and_logs_metrics(capsys, text, tmp_path):
    rc, out, err = train(capsys, text, tmp_path / "r", "--max-steps", "8")
    assert rc == 0, err
    lines = out.splitlines()
    assert lines[0].startswith("qkv: 8 steps, 2,048 tokens") and "bits/char" in lines[0]
    assert lines[1] == "--- sample ---" and len(out) > len(lines[0]) + 20
    assert "Traceback" not in err
    names = sorted(p.name for p in (tmp_path / "r").iterdir())
    assert names == [".lock", "checkpoint.json", "config.json", "metrics.csv", "model.safetensors", "tokenizer.json", "train_state.json",
                     "train_state.safetensors"]
    header = (tmp_path / "r" / "metrics.csv").read_text().splitlines()[0].split(",")
    assert header[:4] == ["step", "loss", "val_loss", "lr"] and "tokens_per_s" in header
    assert tuple(header) == COLUMNS
    rows = MetricsLog.read(tmp_path / "r" / "metrics.csv")
    assert [int(r["step"]) for r in rows if r["loss"]] == list(range(1, 9))
    assert all(float(r["tokens_per_s"]) > 0 for r in rows if r["loss"])
    tiny_lr, tiny_min_lr, warmup = 3e-3, 3e-4, 5
    lrs = [float(r["lr"]) for r in rows if r["loss"]]
    assert lrs[:warmup] == pytest.approx([tiny_lr * (s + 1) / warmup for s in range(warmup)], rel=1e-5)
    assert lrs[-1] == pytest.approx(tiny_min_lr, rel=1e-5)  # cosine ends at min_lr on the last step
    final = rows[-1]
    assert final["step"] == "8" and final["loss"] == "" and math.isfinite(float(final["val_loss"]))
    state = json.loads((tmp_path / "r" / "train_state.json").read_text())
    assert state["step"] == 8 and state["trainer"]["tokens"] == 8 * 8 * 32


def test_eval_json_is_consistent_and_matches_the_training_summary(capsys, run, tmp_path_factory):
    summary = trained_run(tmp_path_factory)[1]
    rc, out, err = cli(capsys, "eval", run, "--json")
    assert rc == 0, err
    result = json.loads(out)
    assert set(result) >= {"loss", "perplexity", "bits_per_char", "tokens", "characters"}
    assert result["bits_per_char"] * math.log(2) * result["characters"] == pytest.approx(
        result["loss"] * result["tokens"], rel=1e-6)
    assert result["perplexity"] == pytest.approx(math.exp(result["loss"]), rel=1e-9)
    assert round(result["bits_per_char"], 4) == summary["val_bits_per_char"]  # same text, same windows
    assert summary["steps"] == 12 and summary["tokens"] == 12 * 8 * 32
    # a loss below uniform guessing: 12 steps on repetitive verse learn something
    assert result["loss"] < math.log(280)
    rc, text_out, _ = cli(capsys, "eval", run)
    assert rc == 0 and "bits_per_char" in text_out


def test_eval_of_other_text_counts_its_characters(capsys, run, tmp_path):
    other = tmp_path / "other.txt"
    other.write_text("Thou art more fair than morning light.\n" * 3)
    rc, out, _ = cli(capsys, "eval", run, "--data", other, "--json")
    assert rc == 0 and json.loads(out)["characters"] == len(other.read_text())


def test_relative_data_path_still_works_from_another_directory(capsys, text, tmp_path, monkeypatch):
    shutil.copy(text, tmp_path / "verse.txt")
    monkeypatch.chdir(tmp_path)
    rc, _, err = train(capsys, "verse.txt", "rel", "--max-steps", "2", "--no-sample")
    assert rc == 0, err
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    rc, out, err = cli(capsys, "eval", "../rel", "--json")
    assert rc == 0 and json.loads(out)["tokens"] > 0, err
    rc, _, err = cli(capsys, "train", "--out", "../rel", "--resume", "--max-steps", "3", "--quiet", "--no-sample")
    assert rc == 0 and "from the checkpoint at step 2" in err, err


def test_generate_seeds_and_greedy(capsys, run):
    def generate(*extra):
        rc, out, err = cli(capsys, "generate", run, "--prompt", "The moon", "--max-new-tokens", "24", *extra)
        assert rc == 0 and "Traceback" not in err, err
        assert out.startswith("The moon")
        return out

    assert generate("--strategy", "sample", "--seed", "1") == generate("--strategy", "sample", "--seed", "1")
    samples = {generate("--strategy", "sample", "--seed", str(seed), "--temperature", "1.5") for seed in range(3)}
    assert len(samples) == 3
    both = generate("--strategy", "top-k", "--top-k", "5", "--top-p", "0.5", "--seed", "4")
    assert both == generate("--strategy", "top-p", "--top-p", "0.5", "--top-k", "5", "--seed", "4")  # one rule
    greedy = generate("--strategy", "greedy", "--seed", "1")
    rc, _, err = cli(capsys, "generate", run, "--prompt", "x", "--max-new-tokens", "2", "--strategy", "greedy",
                     "--seed", "3")
    assert rc == 0 and err.strip() == "qkv: warning: --seed does not apply to --strategy greedy (it draws nothing)"
    assert greedy == generate("--strategy", "greedy", "--seed", "2") == generate("--strategy", "greedy")
    assert greedy == greedy_by_hand(run, "The moon", 24) + "\n"
    rc, _, err = cli(capsys, "generate", run, "--prompt", "x", "--max-new-tokens", "2", "--kv-dtype", "fp16")
    assert rc == 0 and err.strip() == "qkv: KV cache in fp16 (keys and values rounded as they are written)", err


def greedy_by_hand(run_dir: Path, prompt: str, new: int) -> str:
    """Argmax decoding with a full forward per token (no KV cache): an independent oracle for the CLI."""
    from qkv.formats import load

    loaded = load(run_dir)
    tok = loaded.tokenizer
    ids = [tok.eos_id] + tok.encode(prompt)
    start = len(ids)
    with torch.no_grad():
        for _ in range(new):
            nxt = int(loaded.model(torch.tensor([ids]))[0, -1].argmax())
            if nxt == tok.eos_id:
                break
            ids.append(nxt)
    return prompt + tok.decode(ids[start:])


def test_presets_json_lists_tiny_and_shakespeare(capsys):
    rc, out, _ = cli(capsys, "presets", "--json")
    rows = {row["name"]: row["description"] for row in json.loads(out)}
    assert rc == 0 and {"tiny", "shakespeare"} <= set(rows) and all(rows.values())
    rc, out, _ = cli(capsys, "presets")
    assert rc == 0 and any(line.startswith("tiny ") for line in out.splitlines())


# ---- run dirs: refusing, resuming -------------------------------------------------------------------
def snapshot(folder: Path) -> dict[str, tuple[bytes, int]]:
    return {str(p.relative_to(folder)): (p.read_bytes(), p.stat().st_mtime_ns) for p in folder.rglob("*")
            if p.is_file()}


def test_existing_run_dir_is_refused_and_left_untouched(capsys, text, run):
    before = snapshot(run)
    rc, out, err = train(capsys, text, run, "--max-steps", "2")
    assert rc == 2 and err.startswith("qkv: error:") and "already exists" in err and "--resume" in err
    assert len(err.strip().splitlines()) == 1 and out == ""
    assert snapshot(run) == before


def test_resume_without_a_checkpoint_starts_from_step_zero(capsys, run, tmp_path):
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    for name in ("config.json", "tokenizer.json"):
        shutil.copy(run / name, fresh / name)
    rc, out, err = cli(capsys, "train", "--out", fresh, "--resume", "--max-steps", "3", "--quiet", "--no-sample")
    assert rc == 0, err
    assert "no complete checkpoint yet; starting from step 0" in err
    assert [r[0] for r in loss_rows(fresh)] == ["1", "2", "3"]
    assert json.loads((fresh / "train_state.json").read_text())["step"] == 3


@pytest.mark.parametrize("schedule", ["constant", "cosine"])
def test_max_steps_then_resume_equals_one_run(capsys, text, tmp_path, schedule):
    """8 steps in one go vs 4, then --resume --max-steps 8. With a constant schedule the losses and weights
    are bit-identical; with cosine the first half was fitted to 4 steps (so it differs), and the resumed
    half follows the schedule of the new total, ending at min_lr."""
    s = ("--set", f"train.schedule={schedule}", "--set", "train.warmup_steps=2", "--no-sample")
    assert train(capsys, text, tmp_path / "one", "--max-steps", "8", *s)[0] == 0
    assert train(capsys, text, tmp_path / "two", "--max-steps", "4", *s)[0] == 0
    assert json.loads((tmp_path / "two" / "train_state.json").read_text())["step"] == 4
    rc, _, err = cli(capsys, "train", "--out", tmp_path / "two", "--resume", "--max-steps", "8", "--quiet",
                     "--no-sample")
    assert rc == 0, err
    one, two = loss_rows(tmp_path / "one"), loss_rows(tmp_path / "two")
    assert [r[0] for r in two] == [str(s) for s in range(1, 9)]
    if schedule == "constant":
        assert two == one
        assert same_weights(tmp_path / "one", tmp_path / "two")
    else:
        assert one[2:4] != two[2:4] and float(two[3][2]) == pytest.approx(3e-4, rel=1e-5)
        assert [r[2] for r in two[4:]] == [r[2] for r in one[4:]] and float(two[-1][2]) == pytest.approx(3e-4)


def test_resume_with_a_bad_limit_leaves_the_config_alone(capsys, run, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(run, copy)
    before = (copy / "config.json").read_bytes()
    rc, _, err = cli(capsys, "train", "--out", copy, "--resume", "--max-time", "-5")
    assert rc == 2 and err.startswith("qkv: error: train.max_time=-5.0")
    assert (copy / "config.json").read_bytes() == before
    assert cli(capsys, "eval", copy, "--json")[0] == 0  # the run still loads


# ---- bad inputs ---------------------------------------------------------------------------------------
def assert_one_error_line(rc: int, out: str, err: str, *fragments: str) -> None:
    assert rc == 2, (out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("qkv: error: "), err
    assert "Traceback" not in err and out == ""
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


def bad_files(folder: Path) -> dict[str, Path]:
    files = {"empty": folder / "empty.txt", "binary": folder / "binary.txt", "json": folder / "bad.json",
             "section": folder / "section.json", "short": folder / "short.txt"}
    files["empty"].write_text("")
    files["binary"].write_bytes(b"The moon \xff\xfe doth sing\n")
    files["json"].write_text('{"model": {"d_model": 64,}')
    files["section"].write_text('{"optim": {"lr": 1}}')
    files["short"].write_text("Upon the silver sea the moon doth sing,\n" * 5)
    return files


TRAIN_ERRORS = {
    "missing data": (["--data", "{tmp}/absent.txt"], ["absent.txt", "no such file"]),
    "empty data": (["--data", "{empty}"], ["empty"]),
    "undecodable": (["--data", "{binary}"], ["not UTF-8", "0xff", "byte offset 9"]),
    "unknown preset": (["--preset", "nope"], ["unknown preset 'nope'", "tiny"]),
    "unknown --set key": (["--set", "model.n_layer=3"], ["unknown key 'n_layer'", "n_layers", "d_model"]),
    "unknown --set section": (["--set", "optim.lr=3"], ["unknown key 'optim'", "model, train, data, parallel"]),
    "bad --set type": (["--set", "model.n_layers=two"], ["model.n_layers='two'", "int"]),
    "bad --set bool": (["--set", "model.bias=maybe"], ["model.bias"]),
    "malformed config": (["--config", "{json}"], ["bad.json", "not valid JSON"]),
    "unknown section": (["--config", "{section}"], ["unknown section 'optim'"]),
    "d_model vs heads": (["--set", "model.d_model=30"], ["model.d_model=30", "n_heads=4"]),
    "seq_len > context": (["--set", "train.seq_len=128"], ["train.seq_len=128", "max_seq_len=64"]),
    "negative max steps": (["--max-steps", "-3"], ["--max-steps", "-3"]),
    "zero max steps": (["--max-steps", "0"], ["positive"]),
    "bad device": (["--set", "train.device=bogus"], ["train.device='bogus'"]),
    "short validation": (["--data", "{short}"], ["validation split too short"]),
    "bad schedule": (["--set", "train.schedule=one-cycle"], ["'one-cycle'", "onecycle"]),
    "bad lr_scaling": (["--set", "train.lr_scaling=cubic"], ["train.lr_scaling='cubic'", "linear"]),
    "bad batch_warmup_start": (["--set", "train.batch_warmup_start=99"], ["train.batch_warmup_start=99"]),
    "bad max_bad_steps": (["--set", "train.max_bad_steps=0"], ["train.max_bad_steps=0"]),
    "bad spike_factor": (["--set", "train.spike_factor=1"], ["train.spike_factor=1.0"]),
    "bad tensorboard": (["--set", "train.tensorboard=yes"], ["train.tensorboard='yes'", "bool"]),
    "bad activation_checkpointing": (["--set", "train.activation_checkpointing=2"], ["activation_checkpointing"]),
    "ref engine with a time budget": (["--engine", "ref", "--max-time", "5"], ["--engine ref", "--max-steps"]),
}


@pytest.mark.parametrize("case", list(TRAIN_ERRORS))
def test_bad_train_input_is_one_error_line_and_writes_nothing(capsys, text, tmp_path, case):
    paths = {name: str(p) for name, p in bad_files(tmp_path).items()}
    args, fragments = TRAIN_ERRORS[case]
    args = [a.format(tmp=tmp_path, **paths) for a in args]
    data = [] if "--data" in args else ["--data", text]  # the good verse unless the case brings its own
    argv = ["train", *TINY, *data, "--out", tmp_path / "out", "--max-steps", "2", *args]
    assert_one_error_line(*cli(capsys, *argv), *fragments)
    assert not (tmp_path / "out").exists()


def test_bad_inputs_for_eval_and_generate(capsys, run, tmp_path):
    missing = tmp_path / "nowhere"
    for command in (["eval", missing], ["generate", missing, "--prompt", "x"]):
        assert_one_error_line(*cli(capsys, *command), "no such run directory")
    assert_one_error_line(*cli(capsys, "generate", run, "--top-p", "0"), "--top-p=0.0")
    assert_one_error_line(*cli(capsys, "generate", run, "--temperature", "0"), "--temperature")
    assert_one_error_line(*cli(capsys, "generate", run, "--strategy", "nucleus"), "invalid choice")
    assert_one_error_line(*cli(capsys, "generate", run, "--kv-dtype", "fp8"), "invalid choice")
    for strategy, option in (("greedy", "--temperature"), ("greedy", "--top-k"), ("beam", "--top-p"),
                             ("sample", "--top-k"), ("top-p", "--beams"), ("beam", "--temperature")):
        value = "0.5" if option in ("--temperature", "--top-p") else "3"
        assert_one_error_line(*cli(capsys, "generate", run, "--strategy", strategy, option, value),
                              f"{option} does not apply to --strategy {strategy}")
    assert_one_error_line(*cli(capsys, "eval", run, "--stride", "999"), "--stride=999")
    assert_one_error_line(*cli(capsys, "train", "--resume"), "--resume needs --out")
    assert_one_error_line(*cli(capsys, "train", "--resume", "--out", missing), "nothing to resume")
    before = snapshot(run)
    assert_one_error_line(*cli(capsys, "train", "--resume", "--out", run, "--engine", "ref", "--max-steps", "20"),
                          "--engine ref cannot resume")
    assert snapshot(run) == before  # the limit was not written into the run's config
    assert_one_error_line(*cli(capsys, "frobnicate"), "invalid choice")
    corrupt = tmp_path / "corrupt"
    shutil.copytree(run, corrupt)
    data = (corrupt / MODEL_FILE).read_bytes()
    (corrupt / MODEL_FILE).write_bytes(data[: len(data) // 3])
    for command in (["eval", corrupt], ["generate", corrupt, "--prompt", "x"]):
        assert_one_error_line(*cli(capsys, *command), "model.safetensors", "not a readable safetensors file")
    (corrupt / MODEL_FILE).unlink()
    assert_one_error_line(*cli(capsys, "eval", corrupt), "no checkpoint yet")
    (corrupt / "config.json").write_text("{")
    assert_one_error_line(*cli(capsys, "eval", corrupt), "not valid JSON")


def test_ctrl_c_mid_step_saves_that_step_and_exits_130(capsys, text, tmp_path, monkeypatch):
    from qkv.train.loop import Trainer

    original = Trainer.step

    def step_with_ctrl_c(self, *batch, lr):
        if self.state.step == 2:  # during update 3
            os.kill(os.getpid(), signal.SIGINT)
        return original(self, *batch, lr=lr)
    monkeypatch.setattr(Trainer, "step", step_with_ctrl_c)
    rc, out, err = train(capsys, text, tmp_path / "r", "--max-steps", "8", "--no-sample", "--json")
    assert rc == 130 and out == "" and "checkpoint saved at step 3" in err and "--resume" in err, err
    assert json.loads((tmp_path / "r" / "train_state.json").read_text())["step"] == 3
    monkeypatch.setattr(Trainer, "step", original)
    rc, out, err = cli(capsys, "train", "--out", tmp_path / "r", "--resume", "--quiet", "--no-sample", "--json")
    assert rc == 0, err

    def strict(constant):
        raise ValueError(f"not JSON: {constant}")
    summary = json.loads(out, parse_constant=strict)
    assert summary["steps"] == 8 and summary["skipped_steps"] == 0 and summary["spikes"] == 0


# ---- the console entry and a hard kill ---------------------------------------------------------------
def test_python_m_qkv_survives_sigkill_and_resumes_exactly(capsys, text, tmp_path):
    steps, common = 60, ["--max-steps", "60", "--set", "train.checkpoint_every=4", "--no-sample"]
    assert train(capsys, text, tmp_path / "whole", *common)[0] == 0
    env = {**os.environ, "PYTHONPATH": str(SRC), "OMP_NUM_THREADS": "1"}
    killed = tmp_path / "killed"
    argv = [sys.executable, "-m", "qkv", "train", *TINY, "--data", str(text), "--out", str(killed),
            "--set", "train.log_every=1", *common]
    proc = subprocess.Popen(argv, env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE)

    def rows_logged() -> int:
        return len((killed / "metrics.csv").read_text().splitlines()) - 1 if (killed / "metrics.csv").exists() else 0

    deadline = time.monotonic() + 120  # first checkpoint (step 4), then a step or so past it
    while proc.poll() is None and time.monotonic() < deadline and not (
            (killed / "train_state.json").exists() and rows_logged() >= 5):
        time.sleep(0.002)
    proc.send_signal(signal.SIGKILL)
    _, err = proc.communicate()
    assert proc.returncode == -signal.SIGKILL, err.decode()  # killed mid-run, not finished
    rows_before = rows_logged()
    rc, _, err = cli(capsys, "train", "--out", killed, "--resume", "--quiet", "--no-sample")
    assert rc == 0, err
    saved = int(err.split("resuming from the checkpoint at step ")[1].split()[0])
    assert 4 <= saved <= rows_before < steps and saved % 4 == 0
    whole, resumed = loss_rows(tmp_path / "whole"), loss_rows(killed)
    assert [r[0] for r in resumed] == [str(s) for s in range(1, steps + 1)]  # rows past `saved` were cut
    assert resumed == whole
    assert same_weights(tmp_path / "whole", killed)


def test_resume_accepts_the_first_command_again_and_refuses_changes(capsys, text, tmp_path):
    """The command first typed, typed again with --resume, continues the run; a --set, --data or --config that
    would change a value is refused naming the field, and nothing is written."""
    out = tmp_path / "again"
    first = ["train", *TINY, "--data", text, "--out", out, "--set", "train.lr=0.002", "--quiet", "--no-sample"]
    rc, _, err = cli(capsys, *first, "--max-steps", "2")
    assert rc == 0, err
    rc, _, err = cli(capsys, *first, "--max-steps", "3", "--resume")
    assert rc == 0 and "from the checkpoint at step 2" in err, err
    before = snapshot(out)
    other = tmp_path / "other.txt"
    other.write_text("something else entirely\n" * 50)
    config = tmp_path / "c.json"
    config.write_text('{"train": {"lr": 0.005}}')
    for extra, field in ((["--set", "train.lr=0.003"], "train.lr"), (["--data", other], "data.paths"),
                         (["--config", config], "train.lr"), (["--set", "model.d_model=48"], "model.d_model")):
        assert_one_error_line(*cli(capsys, "train", "--out", out, "--resume", "--max-steps", "4", *extra),
                              f"would change {field}")
    assert {k: v for k, v in snapshot(out).items() if k != ".lock"} == \
        {k: v for k, v in before.items() if k != ".lock"}


def test_json_output_is_strict_even_for_a_nan_loss():
    from qkv.cli.options import strict_json

    text = strict_json({"loss": float("nan"), "nested": {"perplexity": float("inf"), "values": [1.0, float("-inf")]}})
    assert json.loads(text) == {"loss": None, "nested": {"perplexity": None, "values": [1.0, None]}}
    assert "NaN" not in text and "Infinity" not in text
