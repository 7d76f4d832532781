"""File formats below every layer that reads or writes them (train, hf, analysis, generate, the run loader).

A run dir (DESIGN.md "Files"):

    config.json                 the RunConfig (qkv.config), written once
    tokenizer.json              the BPE tokenizer (qkv.data.tokenizer), written once
    model.safetensors           weights                       } the checkpoint set, replaced atomically by
    train_state.safetensors     optimizer moments, RNG bytes  } qkv.train.checkpoint (.staging, then .commit)
    train_state.json            step, data position, schedule }
    checkpoint.json             the set's record: each file's size and SHA-256 (written last, checked on resume)
    metrics.csv                 one row per logged step
    .lock                       held (flock) by the one process writing the run: `RunLock`

Tensors are read and written as safetensors and everything else as JSON: nothing is loaded with pickle, so
loading a file never runs code. Every read error is a QkvError that names the file.
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping

from qkv.errors import QkvError

if TYPE_CHECKING:
    import torch
    from torch import nn

CONFIG_FILE = "config.json"
TOKENIZER_FILE = "tokenizer.json"
MODEL_FILE = "model.safetensors"
STATE_TENSORS = "train_state.safetensors"
STATE_JSON = "train_state.json"
CHECKPOINT_FILES = (MODEL_FILE, STATE_TENSORS, STATE_JSON)
RECORD_FILE = "checkpoint.json"
SET_FILES = CHECKPOINT_FILES + (RECORD_FILE,)  # what one save writes and a commit moves
LOCK_FILE = ".lock"


def read_json(path: Path) -> Any:
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise QkvError(f"{path}: no such file") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise QkvError(f"{path}: not valid JSON ({exc})") from None
    except IsADirectoryError:
        raise QkvError(f"{path}: is a directory, expected a JSON file") from None
    except RecursionError:
        raise QkvError(f"{path}: JSON nested too deeply") from None


def read_tensors(path: Path) -> dict[str, "torch.Tensor"]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(str(path))
    except FileNotFoundError:
        raise QkvError(f"{path}: no such file") from None
    except (SafetensorError, OSError, ValueError) as exc:
        raise QkvError(f"{path}: not a readable safetensors file ({exc})") from None


def model_tensors(model: "nn.Module") -> dict[str, "torch.Tensor"]:
    """Parameters (a tied weight once, under its first name) and persistent buffers, on the CPU."""
    tensors = {name: p.detach().to("cpu").contiguous() for name, p in model.named_parameters()}
    return {**tensors, **persistent_buffers(model)}


def persistent_buffers(model: "nn.Module") -> dict[str, "torch.Tensor"]:
    """The buffers a checkpoint holds (not the ones registered persistent=False), on the CPU."""
    return {name: b.detach().to("cpu").contiguous() for name, b in model.named_buffers()
            if name.rpartition(".")[2] not in _non_persistent(model, name)}


def _non_persistent(model: "nn.Module", buffer_name: str) -> set[str]:
    owner = model.get_submodule(buffer_name.rpartition(".")[0]) if "." in buffer_name else model
    return owner._non_persistent_buffers_set


def load_model_tensors(model: "nn.Module", tensors: dict[str, "torch.Tensor"], origin: str) -> None:
    """Copy `tensors` into `model`; every parameter and floating-point persistent buffer (an MoE's choosing bias)
    must be present with its shape (a quantized layer's integer codes have their own loader: qkv.formats.run_dir)."""
    import torch

    buffers = {name: b for name, b in model.named_buffers()
               if b.is_floating_point() and name.rpartition(".")[2] not in _non_persistent(model, name)}
    expected = {**dict(model.named_parameters()), **buffers}
    for name, param in expected.items():
        if name not in tensors:
            raise QkvError(f"{origin}: missing tensor {name!r}; the file does not match config.json")
        if not tensors[name].is_floating_point():  # an integer or bool tensor would be cast silently
            raise QkvError(f"{origin}: {name} is stored as {str(tensors[name].dtype).replace('torch.', '')}; "
                           "weights must be floating point")
        if tuple(tensors[name].shape) != tuple(param.shape):
            raise QkvError(f"{origin}: {name} has shape {tuple(tensors[name].shape)}, "
                           f"config.json needs {tuple(param.shape)}")
        with torch.no_grad():
            param.copy_(shard_like(tensors[name], param))


def assign_model_tensors(model: "nn.Module", tensors: Mapping[str, "torch.Tensor"], origin: str, *,
                         within: Callable[[str], bool] = lambda module_name: True) -> None:
    """Make `tensors` the parameters of `model` (built on the meta device: no memory, no initialisation),
    without copying them: each name checked as load_model_tensors checks it, tied parameters tied again.
    The model must have no buffers (they would stay on the meta device). `within(module name)`: only the
    parameters of the modules it accepts (a loader filling the model a block at a time; the others' parameters
    and buffers are left as they are)."""
    import torch
    from torch import nn

    if any(True for name, _ in model.named_buffers() if within(name.rpartition(".")[0])):
        raise ValueError("assign_model_tensors: the model has buffers; build it on a device and load_model_tensors")
    places: dict[int, list[tuple[nn.Module, str]]] = {}  # one parameter -> every (module, attribute) holding it
    first: dict[int, str] = {}
    for module_name, module in model.named_modules(remove_duplicate=False):
        if not within(module_name):
            continue
        for attribute, param in module.named_parameters(recurse=False):
            places.setdefault(id(param), []).append((module, attribute))
            first.setdefault(id(param), f"{module_name}.{attribute}" if module_name else attribute)
    for key, name in first.items():
        holders = places[key]
        current = getattr(*holders[0])
        if name not in tensors:
            raise QkvError(f"{origin}: missing tensor {name!r}; the file does not match config.json")
        value = tensors[name]
        if not value.is_floating_point():
            raise QkvError(f"{origin}: {name} is stored as {str(value.dtype).replace('torch.', '')}; "
                           "weights must be floating point")
        if tuple(value.shape) != tuple(current.shape):
            raise QkvError(f"{origin}: {name} has shape {tuple(value.shape)}, config.json needs {tuple(current.shape)}")
        new = nn.Parameter(value.to(torch.float32), requires_grad=current.requires_grad)
        for module, attribute in holders:
            setattr(module, attribute, new)


def shard_like(value: "torch.Tensor", param: "torch.Tensor") -> "torch.Tensor":
    """A full tensor laid out as `param`: its own shard of a sharded (DTensor) parameter under FSDP2 or
    tensor parallel, cut locally (every rank read the same file: no communication)."""
    dtensor = sys.modules.get("torch.distributed.tensor")  # not imported: no parameter is a DTensor
    if dtensor is not None and isinstance(param, dtensor.DTensor):
        return dtensor.distribute_tensor(value.to(param.device), param.device_mesh, param.placements,
                                         src_data_rank=None)
    return value


def committed_file(run_dir: Path, name: str) -> Path:
    """Where the newest complete copy of `name` is, without writing anything (a reader must not `recover`:
    it would delete the `.staging` a running trainer is writing): in `.commit` until a save moves it out."""
    pending = Path(run_dir) / ".commit" / name
    return pending if pending.is_file() else Path(run_dir) / name


def has_checkpoint(run_dir: Path) -> bool:
    return all((Path(run_dir) / name).is_file() for name in CHECKPOINT_FILES)


class RunLock:
    """One writer per run dir: an exclusive, non-blocking flock on RUN/.lock, holding the writer's pid.

    The kernel releases a flock when its process ends, however it ends (kill -9 included), so a lock is
    never stale: the .lock file left behind is unlocked and the next writer takes it. A second writer
    gets a QkvError naming the holder's pid. `with RunLock(dir):` or acquire() / release()."""

    def __init__(self, run_dir: Path):
        self.path = Path(run_dir) / LOCK_FILE
        self.fd: int | None = None

    def acquire(self) -> "RunLock":
        import fcntl

        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = self.holder(fd)
            os.close(fd)
            raise QkvError(f"{self.path.parent} is being written by another qkv process (pid {holder}); wait "
                           "for it to finish or choose another --out") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self.fd = fd
        return self

    @staticmethod
    def holder(fd: int) -> str:
        """The pid in a locked .lock file; the holder writes it just after taking the flock, so an empty
        file is read again for up to a second."""
        deadline = time.monotonic() + 1.0
        while not (text := os.pread(fd, 32, 0).decode(errors="replace").strip()) and time.monotonic() < deadline:
            time.sleep(0.005)
        return text or "unknown"

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)  # closing the descriptor drops the flock
            self.fd = None

    def __enter__(self) -> "RunLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def is_empty_run_dir(path: Path) -> bool:
    """No entry but the lock: a dir a writer has only just claimed."""
    return all(entry.name == LOCK_FILE for entry in Path(path).iterdir())


def write_text_atomic(path: Path, text: str) -> None:
    """Write `text` to `path` whole or not at all (a temporary file beside it, then one rename); a missing
    parent directory is created."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    except OSError as exc:
        raise QkvError(f"{path}: cannot write ({exc.strerror or exc}); nothing was written") from None
    finally:
        tmp.unlink(missing_ok=True)


def optimizer_tensors(optimizer: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], list[dict]]:
    """Flatten an optimizer's state to `optim.{index}.{key}` tensors plus JSON param groups."""
    import torch

    sd = optimizer.state_dict()
    tensors = {}
    for index, entry in sd["state"].items():
        for key, value in entry.items():
            tensors[f"optim.{index}.{key}"] = torch.as_tensor(value)
    groups = [{k: v for k, v in g.items()} for g in sd["param_groups"]]
    return tensors, groups


def load_optimizer(optimizer: torch.optim.Optimizer, tensors: dict[str, torch.Tensor], groups: list[dict]) -> None:
    """Load `optimizer_tensors`' form. The kernel choice (fused, foreach) stays this optimizer's: the run that saved
    it may have had other tensors (plain weights where this layout has FSDP2 shards beside plain experts)."""
    kernels = ("fused", "foreach")
    if len(groups) == len(optimizer.param_groups):
        groups = [{**saved, **{key: own[key] for key in kernels if key in own}}
                  for saved, own in zip(groups, optimizer.param_groups)]
    state: dict[int, dict] = {}
    for name, value in tensors.items():
        if name.startswith("optim."):
            _, index, key = name.split(".", 2)
            state.setdefault(int(index), {})[key] = value
    try:
        optimizer.load_state_dict({"state": state, "param_groups": groups})
    except (ValueError, KeyError, RuntimeError) as exc:
        raise QkvError(f"optimizer state does not match the model ({exc})") from None
