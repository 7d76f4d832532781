"""check_run: the one early check of a whole run config, before any data is read or any model is built.

`qkv.config` checks what a config can check alone (types, ranges, combinations of fields). The variant
names belong to the registries beside the code they name; this module asks each registry about its field,
and `qkv.models.build.check_model` the model's entries about their facts (a kernel that needs a window, an
encoding that needs an even head width). Every error names the field, the value and the choices.
"""
from __future__ import annotations

from qkv.config import RunConfig, choice
from qkv.data.corpus import BUNDLED_CORPORA, SPELLINGS
from qkv.data.seq2seq import SEQ2SEQ_TASKS
from qkv.data.sources import SPLITS
from qkv.models.build import check_model
from qkv.errors import QkvError
from qkv.registry import Registry
from qkv.train.objectives import OBJECTIVES
from qkv.train.optim import OPTIMIZERS
from qkv.parallel.pipeline import PIPELINE_SCHEDULES
from qkv.schedules import LR_SCALING, SCHEDULES

NAMED: dict[str, Registry] = {  # section.field -> the registry that names its choices (model: check_model)
    "train.schedule": SCHEDULES,
    "train.optimizer": OPTIMIZERS,
    "train.lr_scaling": LR_SCALING,
    "data.seq2seq_task": SEQ2SEQ_TASKS,
    "data.split": SPLITS,
    "parallel.schedule": PIPELINE_SCHEDULES,
}


def check_run(cfg: RunConfig) -> RunConfig:
    """cfg.validate(), then every name of every section by its registry; returns cfg."""
    cfg.validate()
    check_model(cfg.model)
    for key, registry in NAMED.items():
        section, name = key.split(".")
        registry.check(key, getattr(getattr(cfg, section), name))
    # auto: the objective of model.arch (its qkv.models.build.ARCHITECTURES entry)
    choice("train.objective", cfg.train.objective, ("auto", *OBJECTIVES.names()))
    choice("data.spelling", cfg.data.spelling, SPELLINGS)
    choice("data.corpus", cfg.data.corpus, tuple(BUNDLED_CORPORA))
    whole = getattr(OPTIMIZERS.get(cfg.train.optimizer), "whole_matrices", False)  # e.g. Muon's orthogonalisation
    if whole and (cfg.parallel.zero or cfg.parallel.tp > 1):
        raise QkvError(f"train.optimizer={cfg.train.optimizer} updates whole matrices: it does not run on ZeRO / "
                       "FSDP or tensor-parallel shards (set parallel.zero=0 and parallel.tp=1)")
    return cfg
