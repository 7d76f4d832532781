"""Fine-tuning from another run (`qkv train --init RUN`, train.init): the new model starts from the init run's
weights wherever a parameter has the same name and shape (the encoder of an MLM run, `encoder.*`), and only its
own head (`head.*`) starts fresh, as Hugging Face's `from_pretrained` does for a new task head."""
from __future__ import annotations

import dataclasses

import torch
from torch import nn

from qkv.errors import QkvError
from qkv.files import shard_like
from qkv.formats import load, load_config
from qkv.models import build_model
from qkv.nn.quant import QuantLinear

FRESH = "head."  # parameters the init run need not have: the new task's head


def init_run(path: str):
    """The init run (a qkv run dir, a Hugging Face model dir or a GGUF file), with a one-line error otherwise."""
    return load(path)


def init_config(path: str):
    """The init run's config, its weights unread (the run's model section is built from it)."""
    return load_config(path)


def model_from_init(model_cfg, init_model_cfg, path: str):
    """The model section of a fine-tuning run: the init run's sizes and variants, with this run's head fields."""
    if init_model_cfg.arch != model_cfg.arch:
        raise QkvError(f"--init {path}: a model.arch={init_model_cfg.arch!r} run; this run trains "
                       f"model.arch={model_cfg.arch!r}")
    own = {name: getattr(model_cfg, name) for name in ("head", "n_classes", "pooling", "labels", "dropout")}
    return dataclasses.replace(init_model_cfg, **own)


def same_model(model: nn.Module, cfg) -> bool:
    """Whether `model` is exactly what build_model(cfg) builds (every parameter and buffer by name, shape and
    fp32): then training can start from it as it is, with no copy."""
    with torch.device("meta"):
        built = build_model(cfg)
    fp32 = all(t.dtype == torch.float32 for t in model.parameters())
    return type(model) is type(built) and layout(model) == layout(built) and fp32


def layout(module: nn.Module) -> dict[str, tuple]:
    """{name: (shape, dtype)} of every parameter and buffer."""
    tensors = list(module.named_parameters()) + list(module.named_buffers())
    return {name: (tuple(t.shape), t.dtype) for name, t in tensors}


def load_backbone(model: nn.Module, source: nn.Module, origin: str) -> tuple[int, int]:
    """Copy every parameter of `source` into the same-named parameter of `model`; each parameter of `model`
    outside its head must be found with its shape. Returns (tensors copied, head tensors left fresh)."""
    tensors = dict(source.named_parameters())
    copied = fresh = 0
    for name, param in model.named_parameters():
        if ".lora_" in name:  # LoRA's adapters (qkv.nn.lora) start at B = 0: the model itself
            continue
        name = name.replace(".base_layer.", ".")  # the frozen layer under an adapter has the plain layer's name
        found = tensors.get(name)
        if found is None:
            if name.startswith(FRESH):
                fresh += 1
                continue
            raise QkvError(f"--init {origin}: has no tensor {name!r}; it is not a backbone for this model")
        if tuple(found.shape) != tuple(param.shape):
            raise QkvError(f"--init {origin}: {name} has shape {tuple(found.shape)}, this model needs "
                           f"{tuple(param.shape)}")
        with torch.no_grad():
            param.copy_(shard_like(found, param))  # FSDP2 / tensor parallel: this rank's shard
        copied += 1
    for name, module in model.named_modules():  # QLoRA: a frozen quantized layer takes the init's weight
        if isinstance(module, QuantLinear):
            weight = tensors.get(name.replace(".base_layer", "") + ".weight")
            if weight is None or tuple(weight.shape) != (module.out_features, module.in_features):
                raise QkvError(f"--init {origin}: has no weight for {name} of shape "
                               f"{(module.out_features, module.in_features)}")
            module.set_weight(weight)
            copied += 1
    return copied, fresh
