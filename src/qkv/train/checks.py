"""The pre-flight checks of a training job, before any data is read or any model is built: `preflight` owns
every gate (the names, the layout against the launch, the memory fit, the objective against the model, the
lengths) and `check_run` is its first, the names alone (also what a resumed or written config must pass).

`qkv.config` checks what a config can check alone (types, ranges, combinations of fields). The variant
names belong to the registries beside the code they name; this module asks each registry about its field,
and `qkv.models.build.check_model` the model's entries about their facts (a kernel that needs a window, an
encoding that needs an even head width). Every error names the field, the value and the choices.
"""
from __future__ import annotations

import os

from qkv.config import RunConfig, TrainConfig, choice
from qkv.data.corpus import BUNDLED_CORPORA, SPELLINGS
from qkv.data.seq2seq import SEQ2SEQ_TASKS
from qkv.data.sources import SPLITS
from qkv.models.build import check_model
from qkv.errors import QkvError
from qkv.nn.lora import parse_spec
from qkv.analysis import calc, memory
from qkv.parallel import layout as parallel
from qkv.registry import Registry
from qkv.train import objectives
from qkv.train.objectives import OBJECTIVES, Objective
from qkv.train.optim import OPTIMIZERS
from qkv.parallel.pipeline import PIPELINE_SCHEDULES
from qkv.ref.optim import NS_ITERATIONS
from qkv.schedules import DECAY_SHAPES, LR_SCALING, SCHEDULES

NAMED: dict[str, Registry] = {  # section.field -> the registry that names its choices (model: check_model)
    "train.schedule": SCHEDULES,
    "train.decay_shape": DECAY_SHAPES,
    "train.optimizer": OPTIMIZERS,
    "train.muon_iteration": NS_ITERATIONS,
    "train.lr_scaling": LR_SCALING,
    "data.seq2seq_task": SEQ2SEQ_TASKS,
    "data.split": SPLITS,
    "parallel.schedule": PIPELINE_SCHEDULES,
}


# train options that shape one choice of another train field: option -> (that field, the choice, what it shapes)
APPLIES_TO = {
    "decay_shape": ("schedule", "wsd", "its cooldown"),
    "muon_iteration": ("optimizer", "muon", "its Newton-Schulz iteration"),
    "dpo_beta": ("objective", "dpo", "its preference margin"),
}


def check_applies(tc: TrainConfig) -> None:
    """An option set away from its default on a run without the choice it shapes is refused, saying how to set
    it back (a preset's own setting included: the shakespeare preset's decay_shape under another schedule)."""
    for option, (field, wanted, shapes) in APPLIES_TO.items():
        value, default = getattr(tc, option), getattr(TrainConfig, option)
        if value != default and getattr(tc, field) != wanted:
            raise QkvError(f"train.{option}={value!r} applies to train.{field}={wanted!r} ({shapes}), not "
                           f"{getattr(tc, field)!r}: --set train.{option}={default} to run without it")


def check_run(cfg: RunConfig) -> RunConfig:
    """cfg.validate(), then every name of every section by its registry; returns cfg."""
    cfg.validate()
    check_model(cfg.model)
    for key, registry in NAMED.items():
        section, name = key.split(".")
        registry.check(key, getattr(getattr(cfg, section), name))
    check_applies(cfg.train)
    # auto: the objective of model.arch (its qkv.models.build.ARCHITECTURES entry)
    choice("train.objective", cfg.train.objective, ("auto", *OBJECTIVES.names()))
    choice("data.spelling", cfg.data.spelling, SPELLINGS)
    choice("data.corpus", cfg.data.corpus, tuple(BUNDLED_CORPORA))
    if cfg.train.moe_bias_rate and not cfg.model.moe_choice_bias:
        raise QkvError(f"train.moe_bias_rate={cfg.train.moe_bias_rate} moves the experts' choosing bias: set "
                       "model.moe_choice_bias=true (with model.moe_experts)")
    if cfg.train.router_z_loss_weight and not cfg.model.moe_experts:
        raise QkvError(f"train.router_z_loss_weight={cfg.train.router_z_loss_weight} needs routers: set "
                       "model.moe_experts")
    whole = getattr(OPTIMIZERS.get(cfg.train.optimizer), "whole_matrices", False)  # e.g. Muon's orthogonalisation
    if whole and (cfg.parallel.zero or cfg.parallel.tp > 1):
        raise QkvError(f"train.optimizer={cfg.train.optimizer} updates whole matrices: it does not run on ZeRO / "
                       "FSDP or tensor-parallel shards (set parallel.zero=0 and parallel.tp=1)")
    return cfg


def preflight(cfg: RunConfig, world: int) -> Objective:
    """Every gate of a run, in the order a person would fix them: the names (check_run), the layout against the
    launch's `world` processes, the memory one step needs, the objective against the model, the lengths.
    Returns the objective it will train."""
    check_run(cfg)
    check_lora(cfg)  # before the layout: an adaptation the layout cannot run is refused for that reason
    parallel.check_layout(cfg, world)  # a mis-sized layout fails before the data is read
    check_fits(cfg)
    objective = objectives.for_run(cfg)  # before the tokenization: a model the objective cannot train fails fast
    if cfg.train.seq_len > cfg.model.max_seq_len:
        raise QkvError(f"train.seq_len={cfg.train.seq_len} exceeds model.max_seq_len={cfg.model.max_seq_len}")
    return objective


def check_lora(cfg: RunConfig) -> None:
    """train.lora: a valid spec, on a layout that keeps whole layers and an --init to adapt; SFT and DPO on
    data-parallel layouts."""
    if cfg.train.objective in ("sft", "dpo") and (cfg.parallel.tp > 1 or cfg.parallel.pp > 1):
        raise QkvError(f"train.objective={cfg.train.objective!r} runs on data-parallel layouts (parallel.dp, "
                       "parallel.zero); its packed or paired rows do not go through tensor or pipeline stages")
    if cfg.train.objective == "dpo" and cfg.parallel.ep > 1:
        raise QkvError("train.objective='dpo' runs on data-parallel layouts without parallel.ep (its reference "
                       "model keeps every expert on every rank)")
    if cfg.train.objective in ("sft", "dpo") and cfg.train.batch_warmup_steps:
        raise QkvError(f"train.batch_warmup_steps: train.objective={cfg.train.objective!r} weighs each batch's "
                       "tokens whole; set it to 0")
    if not cfg.train.lora:
        return
    spec = parse_spec(cfg.train.lora)
    if spec.base != "none" and cfg.parallel.zero:
        raise QkvError(f"train.lora base={spec.base} (QLoRA) holds integer codes that ZeRO / FSDP do not shard; use "
                       "parallel.zero=0 (data parallel keeps a whole copy on each rank)")
    if not cfg.train.init:
        raise QkvError("train.lora: LoRA adapts a trained model; give --init RUN_OR_GGUF (a fresh model has nothing "
                       "to keep frozen)")
    if cfg.parallel.tp > 1 or cfg.parallel.pp > 1 or cfg.parallel.ep > 1:
        raise QkvError("train.lora runs on data-parallel layouts (parallel.dp, parallel.zero); tensor, pipeline "
                       "and expert parallel split the layers it wraps")


def check_fits(cfg: RunConfig) -> None:
    """Refuse, before any allocation or data preparation, a run whose step needs more memory per process than
    its device has, by qkv's own calculator (`qkv calc`: weights, gradients, optimizer states and
    activations for this batch, precision, ZeRO stage and checkpointing)."""
    model = calc.trained_model(cfg)
    setup = calc.setup_from(cfg)
    need = memory.training(model, setup)["total"]
    device = parallel.resolve_device(cfg.train.device)
    if device.type == "cuda":
        import torch

        have, where = torch.cuda.get_device_properties(device).total_memory, f"{device}'s"
    else:
        have, where = machine_memory(), "this machine's"
    if have and need > have:
        raise QkvError(f"one training step needs {need / 2 ** 30:,.1f} GiB per process by `qkv calc` (weights, "
                       f"gradients, optimizer states, activations), more than {where} {have / 2 ** 30:,.1f} GiB; "
                       "make the model or train.batch_size smaller, or set train.activation_checkpointing")


def machine_memory() -> int:
    """Bytes of physical memory (0 where the OS does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0
