"""Hugging Face checkpoints in and out (GPT-2, LLaMA, BERT, BART, T5 families).

    run = qkv.load(hf_dir)              # config.json + model.safetensors (or shards) [+ tokenizer.json]
    qkv.formats.hf.save(run, out_dir)           # a dir transformers' from_pretrained loads, same outputs
    qkv.formats.hf.convert_from_hf(hf_dir, run_dir)   # a qkv run dir (qkv convert --from-hf DIR --out RUN)

Reading uses JSON and safetensors only: transformers is never imported here. Each family (one module per
HF `model_type`) maps config and tensor names both ways (qkv.formats.hf.common.HfFamily).
"""
from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from qkv.config import DataConfig, ModelConfig, RunConfig, TrainConfig
from qkv.errors import QkvError
from qkv.files import model_tensors
from qkv.formats.hf import bart, bert, deepseek, gemma, gpt2, gpt_oss, llama, moe, phi3, qwen2, qwen3, t5  # noqa: F401  (each registers its family: the package assembles them)
from qkv.formats.chat import read_chat
from qkv.formats.hf.common import HF_FAMILIES, HfFamily, check_types
from qkv.formats.hf.files import CONFIG, TOKENIZER, WEIGHTS, is_hf_dir, read_config, read_weights, to_json, write_dir
from qkv.formats.hf.tokenizer import ORIGINAL, hf_tokenizer_files, read_tokenizer
from qkv.models.build import check_model
from qkv.nn.quant import quantize_model
from qkv.formats import run_dir
from qkv.formats.base import Run, check_vocabulary, model_with

__all__ = ["convert_from_hf", "is_hf_dir", "load", "save", "supported"]


def supported() -> list[str]:
    """The HF architectures qkv reads and writes."""
    return sorted(arch for name in HF_FAMILIES.names() for arch in HF_FAMILIES.get(name).architectures)


def detect(hf: dict) -> tuple[HfFamily, str]:
    """The family and architecture of an HF config.json; QkvError naming it and the supported ones."""
    if not isinstance(hf, dict):
        raise QkvError("config.json must be a JSON object")
    check_types(hf)
    model_type = hf.get("model_type")
    architectures = hf.get("architectures") or []
    architecture = architectures[0] if architectures else None
    by_architecture = {arch: HF_FAMILIES.get(name) for name in HF_FAMILIES.names()
                       for arch in HF_FAMILIES.get(name).architectures}  # a config.json without model_type
    family = HF_FAMILIES.get(model_type) if model_type in HF_FAMILIES else by_architecture.get(architecture)
    if family is not None and architecture is None:
        architecture = family.architectures[0]  # config.json of a bare config: the family's main class
    if family is None or architecture not in family.architectures:
        raise QkvError(f"Hugging Face architecture {architecture or '(none)'} (model_type {model_type!r}) is not "
                       f"supported; supported: {', '.join(supported())}")
    return family, architecture


def load(path: str | Path, device: str | torch.device = "cpu") -> Run:
    """Read an HF model dir into a qkv Run (model in eval mode). `run.tokenizer` is None without tokenizer.json."""
    path = Path(path)
    if not path.is_dir():
        raise QkvError(f"{path}: no such directory")
    hf, family, cfg = read_model_config(path)
    weights = read_weights(path)
    try:
        tensors = family.to_qkv(weights, cfg)
    except QkvError as exc:
        raise QkvError(f"{path}: {exc}") from None
    model = model_with(cfg, tensors, str(path / WEIGHTS))
    tokenizer, _ = read_tokenizer(path, hf)
    check_vocabulary(tokenizer, cfg.vocab_size, path / "tokenizer.json")
    vocab = tokenizer.vocab_size if tokenizer is not None else cfg.vocab_size
    return Run(path=path, config=run_config(cfg, vocab), model=model.to(device).eval(), tokenizer=tokenizer,
               chat=read_chat(path, hf, vocab))


def config(path: str | Path) -> RunConfig:
    """The Run's config alone (config.json and the tokenizer's size): no weight is read."""
    path = Path(path)
    if not path.is_dir():
        raise QkvError(f"{path}: no such directory")
    hf, _, cfg = read_model_config(path)
    tokenizer, _ = read_tokenizer(path, hf)
    check_vocabulary(tokenizer, cfg.vocab_size, path / "tokenizer.json")
    return run_config(cfg, tokenizer.vocab_size if tokenizer is not None else cfg.vocab_size)


def read_model_config(path: Path) -> tuple[dict, HfFamily, ModelConfig]:
    """(config.json's dict, its family, qkv's config of it), errors naming the file."""
    hf = read_config(path)  # file errors name the file
    try:
        family, architecture = detect(hf)
        cfg = family.config(hf, architecture)
        check_model(cfg)
    except QkvError as exc:
        raise QkvError(f"{path / CONFIG}: {exc}") from None
    return hf, family, cfg


def run_config(cfg: ModelConfig, tokenizer_vocab: int) -> RunConfig:
    """A run config for fine-tuning an imported model: a small learning rate, a short warmup
    (docs/DEVIATIONS.md); data.vocab_size records the tokenizer's size (at least the BPE minimum)."""
    train = TrainConfig(seq_len=min(128, cfg.max_seq_len), lr=1e-4, min_lr=1e-5, warmup_steps=10)
    return RunConfig(model=cfg, train=train, data=DataConfig(vocab_size=max(257, tokenizer_vocab)))


def exporter(cfg: ModelConfig) -> HfFamily:
    if cfg.rope_dims not in (0, cfg.head_dim):
        raise QkvError(f"model.rope_dims={cfg.rope_dims} (a partial rotation): none of the Hugging Face families qkv "
                       "writes turns part of a head; this model cannot be written as one")
    for name in HF_FAMILIES.names():
        if HF_FAMILIES.get(name).exports(cfg):
            return HF_FAMILIES.get(name)
    if cfg.qk_norm:
        raise QkvError("model.qk_norm=true: of the exported Hugging Face families only Qwen3 (LLaMA's layout) and "
                       "Gemma 3 normalise q and k, and this model is neither; it cannot be written as one")
    if cfg.logit_softcap:
        raise QkvError(f"model.logit_softcap={cfg.logit_softcap}: of the exported Hugging Face families only Gemma 2 "
                       "caps its logits, and this model is not Gemma 2's shape; it cannot be written as one")
    if cfg.bigram_vocab:
        raise QkvError(f"model.bigram_vocab={cfg.bigram_vocab}: none of the exported Hugging Face families has a "
                       "bigram embedding; this model cannot be written as one")
    kinds = "; ".join(HF_FAMILIES.get(name).exports_doc for name in HF_FAMILIES.names())
    raise QkvError(f"no Hugging Face family matches this model (arch={cfg.arch}, positional={cfg.positional}, "
                   f"norm={cfg.norm}, ffn={cfg.ffn}); exportable: {kinds}")


def save(run_or_model: Run | nn.Module, out_dir: str | Path, *, config: ModelConfig | None = None) -> Path:
    """Write `out_dir` (new or empty) as an HF model dir: config.json, model.safetensors (fp32) and, for a
    Run with a tokenizer, tokenizer.json + tokenizer_config.json. A bare model needs its `config`."""
    run = run_or_model if isinstance(run_or_model, Run) else None
    model = run.model if run is not None else run_or_model
    cfg = run.config.model if run is not None else config
    if cfg is None:
        raise QkvError("qkv.formats.hf.save(model, dir) needs config=ModelConfig (or pass a Run)")
    family = exporter(cfg)
    architecture, hf = family.hf_config(cfg)
    tensors = family.to_hf(model_tensors(model), cfg)
    hf = {"architectures": [architecture], **hf, "dtype": "float32"}
    tokenizer = run.tokenizer if run is not None else None
    decoder = cfg.arch == "decoder"
    if tokenizer is not None and decoder:  # generation's start and stop token
        hf.update(eos_token_id=tokenizer.eos_id, bos_token_id=tokenizer.eos_id)
    documents = {CONFIG: to_json(hf),
                 **hf_tokenizer_files(tokenizer, original_tokenizer(run), cfg.max_seq_len, decoder)}
    write_dir(Path(out_dir), documents, {name: t.float() for name, t in tensors.items()})
    return Path(out_dir)


def original_tokenizer(run: Run | None) -> str | None:
    """The unmodified HF tokenizer.json a run came from, if any (qkv.formats.hf.tokenizer)."""
    if run is None:
        return None
    for file in (run.path / ORIGINAL, run.path / TOKENIZER if is_hf_dir(run.path) else None):
        if file is not None and file.is_file():
            return file.read_text(encoding="utf-8")
    return None


def convert_from_hf(src: str | Path, out: str | Path, quant: str = "none") -> Path:
    """HF dir -> qkv run dir (config.json, tokenizer.json, model.safetensors [, hf_tokenizer.json]), atomically;
    `quant` int8 / int4: the linear layers' weights saved quantized (qkv.nn.quant)."""
    src = Path(src)
    run = load(src)
    if quant != "none":
        quantize_model(run.model, quant)
    if run.tokenizer is None:
        raise QkvError(f"{src}: a qkv run needs a tokenizer, and this dir has no tokenizer.json "
                       f"(or one without an end-of-text or separator token)")
    return run_dir.save(run, out, extra={ORIGINAL: (src / TOKENIZER).read_text(encoding="utf-8")})
