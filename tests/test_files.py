"""qkv.files: the run-dir layout and its readers, below every layer that uses them."""
import json
import subprocess
import sys

import pytest
import torch
from torch import nn

from qkv import files
from qkv.errors import QkvError


def test_read_json_errors_name_the_file(tmp_path):
    good = tmp_path / "a.json"
    good.write_text(json.dumps({"x": [1, 2.5]}))
    assert files.read_json(good) == {"x": [1, 2.5]}
    broken = tmp_path / "b.json"
    broken.write_bytes(b"\xff{")
    for path, message in ((tmp_path / "none.json", "no such file"), (broken, "not valid JSON"),
                          (tmp_path, "is a directory")):
        with pytest.raises(QkvError, match=message) as info:
            files.read_json(path)
        assert str(path) in str(info.value)


def test_tensors_round_trip_a_tied_weight_once_and_corrupt_files_are_refused(tmp_path):
    from safetensors.torch import save_file

    model = nn.Sequential(nn.Embedding(5, 3), nn.Linear(3, 5, bias=False))
    model[1].weight = model[0].weight  # tied: stored once, under its first name
    tensors = files.model_tensors(model)
    assert list(tensors) == ["0.weight"]
    save_file(tensors, str(tmp_path / files.MODEL_FILE))
    other = nn.Sequential(nn.Embedding(5, 3), nn.Linear(3, 5, bias=False))
    other[1].weight = other[0].weight
    files.load_model_tensors(other, files.read_tensors(tmp_path / files.MODEL_FILE), "x")
    assert torch.equal(other[1].weight, model[0].weight)
    (tmp_path / "bad.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(QkvError, match="not a readable safetensors file"):
        files.read_tensors(tmp_path / "bad.safetensors")
    with pytest.raises(QkvError, match="has shape"):
        files.load_model_tensors(nn.Linear(2, 2), {"weight": torch.zeros(3, 2), "bias": torch.zeros(2)}, "x")


def test_committed_file_prefers_a_pending_commit(tmp_path):
    (tmp_path / files.MODEL_FILE).write_bytes(b"old")
    assert files.committed_file(tmp_path, files.MODEL_FILE) == tmp_path / files.MODEL_FILE
    (tmp_path / ".commit").mkdir()
    (tmp_path / ".commit" / files.MODEL_FILE).write_bytes(b"new")
    assert files.committed_file(tmp_path, files.MODEL_FILE) == tmp_path / ".commit" / files.MODEL_FILE
    assert not files.has_checkpoint(tmp_path)


@pytest.mark.parametrize("module", ["qkv.formats.hf", "qkv.analysis.calc", "qkv.formats", "qkv.generate", "qkv.serve.server"])
def test_readers_do_not_climb_into_training(module):
    """Hugging Face conversion, the calculators, the run loader, generation and the server read run dirs through
    qkv.files: none of them imports qkv.train."""
    code = f"import sys, {module}; print(sorted(m for m in sys.modules if m.startswith('qkv.train')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
