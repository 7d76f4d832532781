"""Checkpoints: exact round trips, and a save interrupted at any point recovers to one complete set."""
import json
import os

import pytest
import torch

from qkv.config import TrainConfig
from qkv.errors import QkvError
from qkv.models import build_model
from qkv import files
from qkv.train import checkpoint
from qkv.files import MODEL_FILE, SET_FILES, STATE_JSON, STATE_TENSORS
from qkv.train.optim import OPTIMIZERS

TC = TrainConfig(lr=1e-2)


def train_steps(model, optimizer, steps: int, seed: int = 0) -> list[float]:
    g = torch.Generator().manual_seed(seed)
    losses = []
    for _ in range(steps):
        ids = torch.randint(0, 32, (2, 9), generator=g)
        loss = torch.nn.functional.cross_entropy(model(ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def save_set(run_dir, model, optimizer, step: int) -> None:
    tensors, groups = files.optimizer_tensors(optimizer)
    checkpoint.save(run_dir, model, tensors, {"step": step, "optimizer": groups})


def load_set(run_dir, cfg):
    model = build_model(cfg)
    files.load_model_tensors(model, files.read_tensors(run_dir / MODEL_FILE), "test")
    optimizer = OPTIMIZERS.get("adamw")(model, TC)
    tensors, state = checkpoint.load_state(run_dir)
    files.load_optimizer(optimizer, tensors, state["optimizer"])
    return model, optimizer, state


def same_weights(a, b) -> bool:
    return all(torch.equal(p, q) for p, q in zip(a.state_dict().values(), b.state_dict().values()))


def test_save_load_gives_bit_identical_next_steps(tmp_path, tiny_cfg):
    model = build_model(tiny_cfg)
    optimizer = OPTIMIZERS.get("adamw")(model, TC)
    train_steps(model, optimizer, 3)
    save_set(tmp_path, model, optimizer, step=3)
    restored, restored_opt, state = load_set(tmp_path, tiny_cfg)
    assert state["step"] == 3 and same_weights(model, restored)
    assert train_steps(model, optimizer, 4, seed=1) == train_steps(restored, restored_opt, 4, seed=1)
    assert same_weights(model, restored)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(SET_FILES)  # no staging left


def test_tied_head_is_stored_once(tmp_path, tiny_cfg):
    model = build_model(tiny_cfg)
    names = set(files.model_tensors(model))
    assert names == {n for n, _ in model.named_parameters()}
    assert len(names) == len(list(model.parameters()))


def test_missing_or_misshapen_tensor_is_a_clear_error(tiny_cfg):
    model = build_model(tiny_cfg)
    tensors = files.model_tensors(model)
    with pytest.raises(QkvError, match="missing tensor 'final_norm.weight'"):
        files.load_model_tensors(model, {k: v for k, v in tensors.items() if k != "final_norm.weight"}, "f")
    tensors["final_norm.weight"] = torch.zeros(3)
    with pytest.raises(QkvError, match=r"final_norm.weight has shape \(3,\)"):
        files.load_model_tensors(model, tensors, "f")


@pytest.fixture
def two_sets(tmp_path, tiny_cfg):
    """A run dir holding complete set A (step 1); returns (model at A, model at B, optimizer at B)."""
    model = build_model(tiny_cfg)
    optimizer = OPTIMIZERS.get("adamw")(model, TC)
    train_steps(model, optimizer, 1)
    save_set(tmp_path, model, optimizer, step=1)
    at_a = build_model(tiny_cfg)
    at_a.load_state_dict(model.state_dict())
    train_steps(model, optimizer, 1, seed=5)
    return at_a, model, optimizer


def assert_complete_set(run_dir, cfg, expected_model, step: int) -> None:
    assert files.has_checkpoint(run_dir) and checkpoint.verify_set(run_dir) == "complete"  # sizes, hashes
    assert not (run_dir / ".staging").exists() and not (run_dir / ".commit").exists()
    model, _, state = load_set(run_dir, cfg)
    assert state["step"] == step and same_weights(model, expected_model)


def test_partial_staging_is_discarded(tmp_path, tiny_cfg, two_sets):
    at_a, _, _ = two_sets
    staging = tmp_path / ".staging"
    staging.mkdir()
    (staging / MODEL_FILE).write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{")  # cut off mid-header
    checkpoint.recover(tmp_path)
    assert_complete_set(tmp_path, tiny_cfg, at_a, step=1)


def test_crash_before_the_commit_rename_keeps_the_old_set(tmp_path, tiny_cfg, two_sets, monkeypatch):
    at_a, at_b, optimizer = two_sets

    def crash(src, dst):
        raise OSError("power cut")

    monkeypatch.setattr(checkpoint.os, "rename", crash)
    with pytest.raises(OSError, match="power cut"):
        save_set(tmp_path, at_b, optimizer, step=2)
    assert (tmp_path / ".staging").is_dir()  # complete but never committed
    monkeypatch.undo()
    checkpoint.recover(tmp_path)
    assert_complete_set(tmp_path, tiny_cfg, at_a, step=1)


@pytest.mark.parametrize("moved", range(len(SET_FILES) + 1))
def test_crash_after_the_commit_rolls_forward(tmp_path, tiny_cfg, two_sets, monkeypatch, moved):
    """`moved` of the set's files already replaced when the process dies: recovery completes set B."""
    at_a, at_b, optimizer = two_sets
    real_replace, calls = os.replace, []

    def crash_after(src, dst):
        if len(calls) == moved:
            raise OSError("killed")
        calls.append(src)
        real_replace(src, dst)

    monkeypatch.setattr(checkpoint.os, "replace", crash_after)
    if moved == len(SET_FILES):  # every file moved; the process dies before removing the empty `.commit`
        monkeypatch.setattr(checkpoint.shutil, "rmtree", lambda path: crash_after(None, None))
    with pytest.raises(OSError, match="killed"):
        save_set(tmp_path, at_b, optimizer, step=2)
    monkeypatch.undo()
    left = sorted(p.name for p in (tmp_path / ".commit").iterdir())
    assert left == sorted(SET_FILES[moved:])
    assert files.committed_file(tmp_path, MODEL_FILE).parent.name == (".commit" if moved == 0 else tmp_path.name)
    checkpoint.recover(tmp_path)
    assert_complete_set(tmp_path, tiny_cfg, at_b, step=2)


def test_save_over_a_leftover_staging_succeeds(tmp_path, tiny_cfg, two_sets):
    _, at_b, optimizer = two_sets
    (tmp_path / ".staging").mkdir()
    (tmp_path / ".staging" / "junk").write_text("x")
    save_set(tmp_path, at_b, optimizer, step=2)
    assert_complete_set(tmp_path, tiny_cfg, at_b, step=2)


def test_corrupt_files_are_qkv_errors(tmp_path, tiny_cfg, two_sets):
    data = (tmp_path / MODEL_FILE).read_bytes()
    (tmp_path / MODEL_FILE).write_bytes(data[: len(data) // 2])
    with pytest.raises(QkvError, match="not a readable safetensors file"):
        files.read_tensors(tmp_path / MODEL_FILE)
    with pytest.raises(QkvError, match="no such file"):
        files.read_tensors(tmp_path / "absent.safetensors")
    (tmp_path / STATE_JSON).write_text('{"step": 1, "optim')
    with pytest.raises(QkvError, match="corrupt training state"):
        checkpoint.load_state(tmp_path)
    (tmp_path / STATE_JSON).write_text(json.dumps([1, 2]))
    with pytest.raises(QkvError, match="corrupt training state"):
        checkpoint.load_state(tmp_path)


def test_optimizer_state_for_another_model_is_refused(tmp_path, tiny_cfg, two_sets):
    import dataclasses

    other = build_model(dataclasses.replace(tiny_cfg, n_layers=1))
    optimizer = OPTIMIZERS.get("adamw")(other, TC)
    tensors, state = checkpoint.load_state(tmp_path)
    with pytest.raises(QkvError, match="does not match"):
        files.load_optimizer(optimizer, tensors, state["optimizer"])
    assert (tmp_path / STATE_TENSORS).is_file()
