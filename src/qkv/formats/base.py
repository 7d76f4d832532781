"""What every file format gives and takes: a `Run` (model, tokenizer, config), and the `Format` record of the
`FORMATS` registry that `qkv.formats.load` asks in turn.

    detect(path) -> bool             cheap: a look at names and headers, never the weights
    load(path, device) -> Run        the model in eval mode on `device`
    save(run, out, **options) -> Path   writes `out` (new, or an empty dir) from a Run; nothing existing is lost
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from qkv.config import ModelConfig, RunConfig
from qkv.data.tokenizer import Tokenizer
from qkv.errors import QkvError
from qkv.files import assign_model_tensors, load_model_tensors
from qkv.models import build_model
from qkv.nn.moe import MoE
from qkv.registry import Registry


@dataclass(frozen=True)
class Chat:
    """How the model was taught to chat, where its file says: a Jinja chat template (rendered as transformers
    renders it, qkv.formats.chat), the text of its BOS token for the template, and the token ids that end its
    turn (its EOS / end-of-turn tokens: generation stops there, besides qkv's end-of-text)."""

    template: str | None = None
    bos_token: str = ""
    stop_ids: tuple[int, ...] = ()


@dataclass
class Run:
    path: Path
    config: RunConfig
    model: nn.Module
    tokenizer: Tokenizer | None
    chat: Chat = field(default_factory=lambda: Chat())

    @property
    def stop_ids(self) -> tuple[int, ...]:
        """Where generation ends unless told otherwise: qkv's end-of-text and the model's own turn-ending ids."""
        eos = (self.tokenizer.eos_id,) if self.tokenizer is not None else ()
        return tuple(dict.fromkeys(eos + self.chat.stop_ids))


@dataclass(frozen=True)
class Format:
    detect: Callable[[Path], bool]
    load: Callable[..., Run]  # (path, device="cpu"[, convert=...] where `streams`) -> Run
    describe: str  # what it reads, for the error that lists the formats
    # (run, out) -> out; None: qkv reads this format only. Given a default explicitly: a dataclass field
    # without one would take any `object.save` as its default (nnsight adds one) and fail to be defined
    save: Callable[..., Path] | None = None
    config: Callable[..., object] | None = None  # (path) -> its Run's RunConfig without reading weights
    # load takes convert(block): applied to each block as soon as its weights are read (formats.load)
    streams: bool = False


FORMATS: Registry[Format] = Registry("file format")


def check_vocabulary(tokenizer: Tokenizer | None, vocab_size: int, origin: Path) -> None:
    """A tokenizer whose ids the model has no rows for would fail mid-way (an index error in the embedding)."""
    if tokenizer is not None and tokenizer.vocab_size > vocab_size:
        raise QkvError(f"{origin}: {tokenizer.vocab_size} tokens, more than the model's vocab_size={vocab_size}")


def model_with(cfg: ModelConfig, tensors: dict[str, torch.Tensor], origin: str) -> nn.Module:
    """The model of `cfg` with `tensors` as its weights (checked by name and shape; errors name `origin`). Built on
    the meta device and given the tensors themselves, so nothing is drawn or held twice (SmolLM2: its random
    initialisation was 1.0 s of a 1.2 s load); a model with buffers (which would stay on the meta device) is
    built on the CPU and copied into."""
    with torch.device("meta"):
        model = build_model(cfg)
    if any(True for _ in model.buffers()):
        model = build_model(cfg)
        load_model_tensors(model, tensors, origin)
    else:  # (a tensor a mapping gave two untied parameters, or views of one, must not become one storage)
        storages: set[int] = set()
        own = {}
        for name, tensor in tensors.items():
            storage = tensor.untyped_storage().data_ptr()
            own[name] = tensor.clone() if storage in storages else tensor
            storages.add(storage)
        assign_model_tensors(model, own, origin)
    check_routers(model, origin)
    return model


def check_routers(model: nn.Module, origin: str) -> None:
    """An MoE's router weights and choosing bias are finite: a NaN there makes every route undefined (QkvError
    naming the tensor)."""
    for name, module in model.named_modules():
        if isinstance(module, MoE):
            for part, tensor in (("router.weight", module.router.weight), ("router_bias", module.router_bias)):
                if tensor is not None and not bool(torch.isfinite(tensor).all()):
                    raise QkvError(f"{origin}: {name}.{part} has NaN or infinite entries: its routes are undefined")
