"""qkv.nn.forms: a product form chosen by measuring both on this machine, kept in a JSON file per machine, and
measured again where that file cannot be read; the measurements time the same product both ways."""
import json
import shutil

import pytest
import torch

from qkv.nn import decoding_linear, forms


@pytest.fixture
def home(tmp_path, monkeypatch):
    """A home of its own (the file under ~/.cache/qkv) and no choice remembered by this process."""
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setattr(forms, "_known", {})
    return tmp_path


def measured(choice: bool):
    calls = []

    def measure():
        calls.append(1)
        return {"choice": choice, "left_ms": 1.0, "linear_ms": 2.0}
    return measure, calls


def test_a_choice_is_measured_once_and_kept_in_the_file(home, monkeypatch):
    measure, calls = measured(True)
    assert forms.choice("left_fp32", measure) is True and calls == [1]
    assert forms.choice("left_fp32", measure) is True and calls == [1]  # remembered by the process
    saved = json.loads((home / ".cache" / "qkv" / forms.FILE_NAME).read_text())
    entry = saved[f"{forms.machine_key()} | left_fp32"]
    assert entry["choice"] is True and entry["left_ms"] == 1.0 and "date" in entry
    monkeypatch.setattr(forms, "_known", {})  # a later start: read from the file, not measured
    assert forms.choice("left_fp32", measure) is True and calls == [1]
    assert forms.choice("summed_int8") is None  # not measured here yet, and not asked to be
    monkeypatch.setattr(torch, "get_num_threads", lambda: 97)  # another thread count is another machine
    assert forms.choice("left_fp32") is None


def test_a_measurement_leaves_the_random_state_as_it_was(home):
    """A choice may be measured in the middle of a seeded run (the first model load): its random weights must
    not move torch's generator."""
    torch.manual_seed(5)
    expected = torch.rand(3)
    torch.manual_seed(5)
    forms.choice("left_fp32", lambda: {"choice": True, "drawn": float(torch.rand(1000).sum())})
    assert torch.equal(torch.rand(3), expected)


@pytest.mark.parametrize("text", ["{not json", "[1, 2]", '{"KEY | left_bf16": {"choice": "yes"}}', "\udcff"])
def test_a_file_that_cannot_be_read_is_measured_over(home, text):
    path = home / ".cache" / "qkv" / forms.FILE_NAME
    path.parent.mkdir(parents=True)
    path.write_text(text.replace("KEY", forms.machine_key()), encoding="utf-8", errors="surrogateescape")
    measure, calls = measured(False)
    assert forms.choice("left_bf16", measure) is False and calls == [1]
    assert json.loads(path.read_text())[f"{forms.machine_key()} | left_bf16"]["choice"] is False


@pytest.mark.parametrize("left_ms, linear_ms", [(1.0, 2.0), (3.0, 2.0)])
def test_the_faster_form_is_chosen(monkeypatch, left_ms, linear_ms):
    monkeypatch.setattr(forms, "timed", lambda runs: {"left_ms": left_ms, "linear_ms": linear_ms})
    result = forms.measure_left(torch.float32, decoding_linear.left_product, megabytes=1)
    assert result["choice"] is (left_ms < linear_ms)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_left_measurement_runs_both_forms(dtype):
    """A real measurement, small: both forms' products checked equal before they are timed (forms.same)."""
    result = forms.measure_left(dtype, decoding_linear.left_product, megabytes=2)
    assert result["left_ms"] > 0 and result["linear_ms"] > 0
    assert result["choice"] is (result["left_ms"] < result["linear_ms"])


def test_forms_that_differ_are_refused():
    with pytest.raises(RuntimeError, match="different products"):
        forms.same(torch.ones(4), torch.ones(4) * 1.1)
    forms.same(torch.ones(4).bfloat16(), torch.ones(4) * (1 + 2 ** -8))  # bf16's rounding is the same product


@pytest.mark.skipif(shutil.which("c++") is None and shutil.which("g++") is None,
                    reason="torch.compile on the CPU needs a C++ compiler; none on PATH")
@pytest.mark.parametrize("dtype", [torch.float32, torch.int8])
def test_the_summed_measurement_compiles_the_sums_and_checks_them(dtype):
    """The compiled sums over a stack of matrices against torch's kernel a matrix at a time (int8: codes with
    per-row scales, bf16 rows): equal products (checked inside), then timed."""
    decoding_linear.inductor_prims()
    result = forms.measure_summed(dtype, False, decoding_linear.left_product, decoding_linear.stored, megabytes=2)
    torch._dynamo.reset()
    assert result["summed_ms"] > 0 and result["kernels_ms"] > 0
    assert result["choice"] is (result["summed_ms"] < result["kernels_ms"])


def test_a_measurement_runs_without_the_threads_profile_function_and_restores_it(home):
    """The compiling thread's profile function sleeps while the model decodes: never inside a timed pass."""
    import sys

    def profile(frame, event, arg):
        return None

    seen = []
    sys.setprofile(profile)
    try:
        forms.choice("left_bf16", lambda: seen.append(sys.getprofile()) or {"choice": False})
        assert sys.getprofile() is profile
    finally:
        sys.setprofile(None)
    assert seen == [None]


def test_each_form_counts_its_fastest_pass(monkeypatch):
    """Other work only adds time to a pass: the fastest of each form's passes is compared (after a warm pass)."""
    ticks = iter([0, 0, 0, 5, 0, 2, 0, 7, 0, 3])  # the warm passes' starts, then (start, end) of a's and b's
    monkeypatch.setattr(forms.time, "perf_counter", lambda: next(ticks) / 1000)
    assert forms.timed({"a": lambda: None, "b": lambda: None}, rounds=2) == pytest.approx({"a": 5.0, "b": 2.0})


def test_the_dense_measurement_runs_both_precisions():
    """A real measurement, small: the bf16 and fp32 products checked equal to bf16's rounding, then timed."""
    result = forms.measure_dense(rows=16, megabytes=1)
    assert result["bf16_ms"] > 0 and result["fp32_ms"] > 0
    assert result["choice"] is (result["bf16_ms"] < result["fp32_ms"])
