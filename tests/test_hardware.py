"""qkv.hardware and train.precision=auto: bf16 exactly where the CPU (or GPU) multiplies it natively, fp32 where it
would be emulated; the run says which in its first lines and saves the precision it ran at."""
import json

import pytest
import torch

from qkv import hardware
from qkv.analysis import calc
from qkv.parallel import precision
from qkv.presets import get
from tests.cli.test_main import cli
from tests.train import TINY, setup_env

EPYC_ZEN4 = "processor\t: 0\nvendor_id\t: AuthenticAMD\nflags\t\t: fpu sse2 avx2 avx512f avx512bw avx512_bf16 avx512vl\n"
EPYC_ZEN3 = "processor\t: 0\nvendor_id\t: AuthenticAMD\nflags\t\t: fpu sse2 avx2 fma\n"
SAPPHIRE = "processor\t: 0\nflags\t\t: avx512f avx512_bf16 amx_bf16 amx_tile amx_int8\n"
SKYLAKE = "processor\t: 0\nflags\t\t: avx2 avx512f avx512bw avx512vl\n"  # AVX-512, but bf16 only emulated
GRAVITON3 = "processor\t: 0\nFeatures\t: fp asimd sve bf16 i8mm\n"
GRAVITON2 = "processor\t: 0\nFeatures\t: fp asimd atomics\n"


@pytest.mark.parametrize("cpuinfo, flag", [(EPYC_ZEN4, "avx512_bf16"), (SAPPHIRE, "amx_bf16"), (GRAVITON3, "bf16"),
                                           (EPYC_ZEN3, None), (SKYLAKE, None), (GRAVITON2, None), ("", None)])
def test_native_bf16_is_read_from_the_cpu_flags(cpuinfo, flag):
    assert hardware.native_bf16_from(cpuinfo) == flag


def test_auto_is_bf16_only_where_it_is_native():
    assert hardware.auto_precision("cpu", cpu_flag="avx512_bf16") == (
        "bf16", "this CPU multiplies bf16 natively (avx512_bf16)")
    chosen, why = hardware.auto_precision("cpu", cpu_flag=None)
    assert chosen == "fp32" and "emulated" in why
    assert hardware.auto_precision("cuda", cuda_bf16=True)[0] == "bf16"
    assert hardware.auto_precision("cuda", cuda_bf16=False)[0] == "fp32"
    assert hardware.auto_precision("mps")[0] == "fp32"


def test_resolve_keeps_a_given_precision_and_reads_this_machine_for_auto():
    cpu = torch.device("cpu")
    for given in ("fp32", "bf16", "fp16"):
        assert precision.resolve(given, cpu)[0] == given
    expected = "bf16" if hardware.native_bf16_cpu() else "fp32"
    assert precision.resolve("auto", cpu)[0] == expected
    cfg = get("shakespeare")
    assert cfg.train.precision == "auto"  # the default job follows the machine
    assert calc.auto_precision(cfg.train) == expected  # qkv calc counts what a run here would do


@pytest.mark.parametrize("flag", ["avx512_bf16", None])
def test_a_run_says_what_auto_chose_and_saves_it(capsys, tmp_path, monkeypatch, tmp_path_factory, flag):
    text = setup_env(monkeypatch, tmp_path_factory)
    monkeypatch.setattr(hardware, "native_bf16_cpu", lambda: flag)
    out = tmp_path / "run"
    code, _, err = cli(capsys, "train", *TINY, "--data", text, "--out", out, "--max-steps", "2", "--no-sample",
                       "--set", "train.precision=auto")
    assert code == 0, err
    chosen = "bf16" if flag else "fp32"
    line = next(line for line in err.splitlines() if line.startswith("qkv: train.precision=auto"))
    assert line.startswith(f"qkv: train.precision=auto -> {chosen}: ")
    assert (flag in line) if flag else ("emulated" in line)
    assert json.loads((out / "config.json").read_text())["train"]["precision"] == chosen  # what ran, for resume
    code, _, err = cli(capsys, "train", *TINY, "--data", text, "--out", tmp_path / "given", "--max-steps", "2",
                       "--no-sample", "--set", "train.precision=fp32")
    assert code == 0 and "train.precision=auto" not in err


def test_the_cpu_model_is_read_from_cpuinfo():
    from qkv import hardware

    intel = ("processor\t: 0\nvendor_id\t: GenuineIntel\ncpu family\t: 6\nmodel name\t: Intel(R) Xeon(R) Platinum 8488C\n"
             "flags\t\t: fpu avx2\n")
    assert hardware.cpu_model_from(intel) == "Intel(R) Xeon(R) Platinum 8488C"
    assert hardware.cpu_model_from("processor\t: 0\nmodel name\t: AMD EPYC\n") == "AMD EPYC"
    assert hardware.cpu_model_from("processor : 0\nFeatures : fp asimd bf16\n") is None  # Arm's names no model
