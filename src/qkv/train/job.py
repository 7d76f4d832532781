"""`qkv train` as a function: resolve the config, prepare data, create or resume the run dir, train."""
from __future__ import annotations

import contextlib
import dataclasses
import os
from pathlib import Path
from typing import Callable

import numpy as np

from qkv import files, presets
from qkv.train.checks import check_run, preflight
from qkv.config import RunConfig, merge_file
from qkv.data.tokenizer import Tokenizer
from qkv.errors import QkvError
from qkv.files import CONFIG_FILE, TOKENIZER_FILE
from qkv.train import checkpoint, finetune, tasks
from qkv.models.build import objective_of
from qkv.parallel import layout as parallel
from qkv.parallel import precision
from qkv.train.loop import Trainer
from qkv.train.plan import check_plan
from qkv.evaluate.tokens import score_tokens
from qkv.formats import peft, run_dir
from qkv.nn.lora import parse_spec


def resolve_config(*, preset: str, config_file: str | None, overrides: list[str], data: list[str],
                   max_steps: int | None, max_time: float | None, task: str | None = None,
                   init: str | None = None, lora: str | None = None) -> RunConfig:
    """preset, then the JSON file's sections, then the --task, then --set, then the dedicated flags. With
    --init, the model's sizes and variants are the init run's (its weights must fit), the head this run's."""
    cfg = presets.get(preset)
    if config_file:
        cfg = merge_file(cfg, Path(config_file))
    if task:
        cfg = tasks.TASKS.get(task).apply(cfg)
    if init:
        model = finetune.model_from_init(cfg.model, finetune.init_config(init).model, init)
        seq_len = min(cfg.train.seq_len, model.max_seq_len)  # the preset's rows, within the init model's context
        cfg = dataclasses.replace(cfg, model=model, train=dataclasses.replace(cfg.train, init=os.path.abspath(init),
                                                                              seq_len=seq_len))
    cfg = cfg.override(overrides)
    if lora:  # the spec as qkv writes it (checked here: a bad spec fails before anything is read)
        cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, lora=parse_spec(lora).to_text()))
    if data:
        cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, paths=tuple(data)))
    # absolute, so that a resume or `qkv eval` from another working directory reads the same text
    paths = tuple(os.path.abspath(os.path.expanduser(path)) for path in cfg.data.paths)
    cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, paths=paths))
    return with_limits(cfg, max_steps, max_time)


def with_limits(cfg: RunConfig, max_steps: int | None, max_time: float | None) -> RunConfig:
    train = cfg.train
    if max_steps is not None:
        train = dataclasses.replace(train, max_steps=max_steps, max_time=0.0 if max_time is None else train.max_time)
    if max_time is not None:
        train = dataclasses.replace(train, max_time=max_time)
    return dataclasses.replace(cfg, train=train)


def default_out(preset: str) -> Path:
    """runs/<preset>, or the first runs/<preset>-N that does not exist: nothing is overwritten."""
    base = Path("runs") / preset
    candidate, n = base, 1
    while candidate.exists():
        n += 1
        candidate = base.with_name(f"{preset}-{n}")
    return candidate


def check_launch(cfg: RunConfig) -> None:
    """Under torchrun, a new run's layout against the launch's process count before its dir is made
    (parallel.check_world: a refused rank may be stopped before it cleans up); one process asks it in preflight,
    after the refusals that name an option."""
    if parallel.env_world() > 1:
        parallel.check_world(cfg, parallel.env_world())


@contextlib.contextmanager
def claim(out: Path, *, resume: bool):
    """Hold the run dir's lock (files.RunLock) for the duration: rank 0 of a launch, or the one process.

    A new run creates its dir first (the lock lives in it); if the run then fails before writing anything,
    the dir it created is removed again."""
    if parallel.env_rank() != 0:
        yield
        return
    if resume and not out.is_dir():
        raise QkvError(f"{out}: nothing to resume (no such directory)")
    if out.exists() and not out.is_dir():
        raise QkvError(f"{out} exists and is not a directory; choose another --out")
    if not resume:
        refuse_existing(out)  # before the lock: a run dir that exists is not touched, not even its .lock
    created = not out.exists()
    if not resume:
        out.mkdir(parents=True, exist_ok=True)
    lock = files.RunLock(out).acquire()
    try:
        yield
    finally:
        lock.release()
        if created and out.is_dir() and files.is_empty_run_dir(out):
            (out / files.LOCK_FILE).unlink(missing_ok=True)
            out.rmdir()


def refuse_existing(out: Path) -> None:
    """QkvError when `out` holds a run; asked by rank 0 alone: under torchrun rank 0 may already have written
    the new run's config while another rank is still starting, which must not read that as someone else's run."""
    if parallel.env_rank() != 0:
        return
    if out.is_dir() and not files.is_empty_run_dir(out):
        raise QkvError(f"{out} already exists; pass --resume to continue it or choose another --out")


def start(out: Path, cfg: RunConfig, *, resume: bool, log: Callable[[str], None],
          progress: bool = True, confirmed: bool = True) -> tuple[Trainer, RunConfig]:
    """Create (or reopen, with resume) the run dir and return a ready Trainer, after printing its plan
    (qkv.train.plan: a plan of more than a day with no time budget needs `confirmed`)."""
    if resume:
        if not (out / CONFIG_FILE).is_file():
            raise QkvError(f"{out}: nothing to resume (no {CONFIG_FILE})")
    else:
        refuse_existing(out)  # again under the lock: another writer may have filled it meanwhile
    cfg, chosen = precision.resolved(cfg, parallel.resolve_device(cfg.train.device))  # auto: what it means here
    if chosen:
        log(chosen)
    objective = preflight(cfg, parallel.env_world())  # every gate, before the data is read
    own_tokenizer = out / TOKENIZER_FILE
    if resume and not own_tokenizer.is_file():  # the saved weights' ids mean its tokens: never retrain it
        raise QkvError(f"{own_tokenizer}: missing; the run's weights are indexed by its token ids, so it cannot "
                       "be trained again: restore it")
    init = None if resume or not cfg.train.init else finetune.init_run(cfg.train.init)
    chat = init.chat if init is not None else None
    if resume and own_tokenizer.is_file():  # a resumed or imported run keeps its tokenizer and vocabulary
        tokenizer = Tokenizer.load(own_tokenizer)
        prepared = objective.prepare(cfg, tokenizer, run_dir.read_chat(out, tokenizer.vocab_size))
    elif init is not None:  # fine-tuning keeps the init run's tokenizer and vocabulary (and how it chats)
        prepared = objective.prepare(cfg, init.tokenizer, chat)
        prepared.tokenizer.add_specials(objective.specials)
    else:
        prepared = objective.prepare(cfg, None)
        prepared.tokenizer.add_specials(objective.specials)  # MASK / PAD after the trained ids; V counts them
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, vocab_size=prepared.tokenizer.vocab_size))
    short = isinstance(prepared.val, np.ndarray) and len(prepared.val) <= cfg.train.seq_len + 1  # a token stream
    if short:  # else the final evaluation fails after all the training
        raise QkvError(f"validation split too short: {len(prepared.val)} tokens, but train.seq_len="
                       f"{cfg.train.seq_len} needs more than {cfg.train.seq_len + 1}; give more text "
                       f"or raise data.val_fraction (now {cfg.data.val_fraction})")
    if prepared.tokenizer.vocab_size > cfg.model.vocab_size:
        raise QkvError(f"{own_tokenizer}: {prepared.tokenizer.vocab_size} tokens, more than the model's "
                       f"vocab_size={cfg.model.vocab_size}")
    whole = init is not None and finetune.same_model(init.model, cfg.model)  # train the init model itself
    trainer = Trainer(out, cfg, prepared, progress=progress, log=log,
                      model=init.model if whole else None)  # may fail: before anything is written
    if whole:
        log(f"qkv: starting from {cfg.train.init}, all {len(list(init.model.parameters()))} tensors")
    elif init is not None:
        copied, fresh = finetune.load_backbone(trainer.model, init.model, cfg.train.init)
        log(f"qkv: {copied} tensors from {cfg.train.init}" + ("; the head starts fresh" if fresh else ""))
    init = None  # nothing else holds the init run: its memory is the trainer's or free
    if not resume:
        check_plan(trainer, log, confirmed)  # before anything is written
    if not resume and trainer.layout.is_main:  # under torchrun rank 0 alone writes the run dir
        out.mkdir(parents=True, exist_ok=True)
        cfg.save(out / CONFIG_FILE)
        prepared.tokenizer.save(out / TOKENIZER_FILE)
        if chat is not None:  # a fine-tuned chat model chats as its init did (qkv chat RUN, qkv serve RUN)
            run_dir.save_chat(out, chat)
    if objective.setup is not None:  # e.g. DPO's reference log-probabilities, by the init model as it starts
        objective.setup(trainer, resume)
    if resume and not trainer.resume():
        if not (out / "model.safetensors").is_file():
            log(f"{out}: no complete checkpoint yet; starting from step 0")
    elif resume:
        log(f"{out}: resuming from the checkpoint at step {trainer.state.step}")
    if resume:
        check_plan(trainer, log, confirmed)  # what is left of it
        save_resumed_config(out, cfg)
    return trainer, cfg


def resume_config(out: Path, max_steps: int | None, max_time: float | None, layout: list[str] = (), *,
                  data: list[str] = (), config_file: str | None = None, preset: str | None = None) -> RunConfig:
    """A resumed run keeps its own config. The limits (--max-steps, --max-time) and the process layout
    (--set parallel.*=..., e.g. a dp=2 run continued in one process) may change; any other --set, --data,
    --config or --preset is accepted when it gives the values the run already has (the command first typed,
    typed again) and refused, naming the fields, when it would change one."""
    if not (out / CONFIG_FILE).is_file():
        raise QkvError(f"{out}: nothing to resume (no {CONFIG_FILE})")
    if parallel.env_rank() == 0:
        checkpoint.recover(out)  # finish an interrupted save
    if checkpoint.verify_set(out) == "complete":  # a damaged set is refused before any work
        checkpoint.check_state_json(files.read_json(out / files.STATE_JSON), out / files.STATE_JSON)
    saved = RunConfig.load(out / CONFIG_FILE)
    if preset is not None:  # the whole first command again: rebuild its config and compare
        asked = resolve_config(preset=preset, config_file=config_file, overrides=list(layout), data=list(data),
                               max_steps=None, max_time=None)
        asked = dataclasses.replace(asked, model=dataclasses.replace(asked.model, vocab_size=saved.model.vocab_size))
    else:  # the given options laid over the run's own config
        asked = merge_file(saved, Path(config_file)) if config_file else saved
        asked = asked.override(list(layout))
        if data:
            paths = tuple(os.path.abspath(os.path.expanduser(path)) for path in data)
            asked = dataclasses.replace(asked, data=dataclasses.replace(asked.data, paths=paths))
    changed = [name for name in differences(saved, asked)
               if not name.startswith("parallel.") and name not in ("train.max_steps", "train.max_time")]
    if changed:
        raise QkvError(f"--resume keeps the run's config, but the options given would change "
                       f"{', '.join(changed[:4])}{' ...' if len(changed) > 4 else ''}; a resume may change only "
                       "--max-steps, --max-time and parallel.* (start a new run for the rest)")
    cfg = dataclasses.replace(saved, parallel=asked.parallel)
    return check_run(with_limits(cfg, max_steps, max_time))  # never write an invalid config


def differences(a: RunConfig, b: RunConfig) -> list[str]:
    """The `section.field` names whose values differ."""
    out = []
    for section, fields in a.to_dict().items():
        other = b.to_dict()[section]
        out += [f"{section}.{name}" for name, value in fields.items() if other[name] != value]
    return out


def save_resumed_config(out: Path, cfg: RunConfig) -> None:
    """Record a resumed run's new limits and layout, once its checkpoint has loaded (a refused resume
    changes nothing): rank 0, replaced atomically (the other ranks may be reading it)."""
    if parallel.env_rank() == 0 and RunConfig.load(out / CONFIG_FILE) != cfg:
        cfg.save(out / (CONFIG_FILE + ".tmp"))
        os.replace(out / (CONFIG_FILE + ".tmp"), out / CONFIG_FILE)


def bits_per_char(trainer: Trainer) -> float | None:
    """The final model's bits per character on the whole validation text (sliding window); None for
    objectives other than lm (an MLM or seq2seq loss is not a per-character code length)."""
    if objective_of(trainer.cfg) != "lm":
        return None
    context = trainer.cfg.model.max_seq_len
    result = score_tokens(trainer.model, trainer.data.val, characters=trainer.data.val_chars,
                          seq_len=context, stride=max(1, context // 2), device=trainer.device)
    return round(result["bits_per_char"], 4)


def write_adapter(trainer: Trainer, out: Path) -> str:
    """The run's LoRA adapters as a PEFT adapter dir (the run dir itself: adapter_config.json and
    adapter_model.safetensors); what was written, or why not, in one line."""
    try:
        peft.save_adapter(trainer.model, trainer.cfg.model, parse_spec(trainer.cfg.train.lora), out)
    except QkvError as error:
        return f"qkv: no PEFT adapter files: {error}"
    return f"qkv: LoRA adapters in PEFT's format: {out / peft.CONFIG}, {out / peft.WEIGHTS}"
