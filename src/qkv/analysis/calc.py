"""`qkv calc`: every calculator on one config, as one JSON-ready dict (SPEC F1).

    params      per component, total, non-embedding, active (MoE)          qkv.analysis.params
    flops       forward / backward / train per component for batch x seq  qkv.analysis.flops
    memory      bytes per GPU: weights, gradients, master, optimizer, activations   qkv.analysis.memory
    kv_cache    inference K/V bytes for batch x seq (bf16/fp16, fp32 for fp32)
    compute     6ND and 3 x forward FLOPs for D training tokens (with --tokens)
    mfu         model FLOPs utilisation for a measured step time and a peak FLOP/s
"""
from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

from qkv import hardware, presets
from qkv.analysis import flops, memory, params
from qkv.config import RunConfig, merge_file
from qkv.errors import QkvError
from qkv.models.build import check_model


def resolve(preset: str | None, config_file: str | None, overrides: list[str]) -> RunConfig:
    """The preset (or the defaults), then the JSON file, then --set; the model section validated."""
    cfg = presets.get(preset) if preset else RunConfig()
    if config_file:
        cfg = merge_file(cfg, Path(config_file))
    cfg = cfg.override(overrides)

    check_model(cfg.model)
    return cfg


def trained_model(cfg: RunConfig):
    """The model a new `qkv train` run of `cfg` builds: its vocabulary is the tokenizer's it trains,
    data.vocab_size tokens (the model section's vocab_size is a placeholder then), or the model's if larger."""
    import dataclasses

    return dataclasses.replace(cfg.model, vocab_size=max(cfg.model.vocab_size, cfg.data.vocab_size))


def auto_precision(tc) -> str:
    """train.precision, with auto as a run would resolve it (qkv.parallel.precision.resolve): bf16 on a CUDA
    device, and on a CPU that multiplies bf16 natively (qkv.hardware); fp32 elsewhere."""
    if tc.precision != "auto":
        return tc.precision
    return hardware.auto_precision(run_device(tc), cuda_bf16=True, cpu_flag=hardware.native_bf16_cpu())[0]


def run_device(tc) -> str:
    """The device a run's memory is planned for: cuda for train.device=cuda[:N]; cpu for cpu and auto (the
    calculator does not look for a GPU)."""
    return "cuda" if tc.device.startswith("cuda") else "cpu"


def setup_from(cfg: RunConfig, **given) -> memory.Setup:
    """Options given on the command line, else the config's: the micro-batch per GPU is
    batch_size / (accumulation x dp), and / parallel.microbatches in a pipeline; the GPUs are parallel.dp."""
    tc, pc = cfg.train, cfg.parallel
    pipeline = given.get("pp") or pc.pp
    for name in ("microbatches", "schedule"):
        if given.get(name) and pipeline == 1:
            raise QkvError(f"--{name} applies to a pipeline: give --pp > 1 (or parallel.pp)")
    micro = (given.get("microbatches") or pc.microbatches) if pipeline > 1 else 1
    default = dict(batch=max(1, tc.batch_size // (tc.accumulation * pc.dp * micro)), seq=tc.seq_len,
                   precision=auto_precision(tc), optimizer=tc.optimizer, zero=pc.zero, gpus=pc.dp,
                   checkpointing=tc.activation_checkpointing, tp=pc.tp, pp=pc.pp, ep=pc.ep,
                   microbatches=micro, schedule=pc.schedule, accumulation=tc.accumulation,
                   split_logits=not tc.label_smoothing,  # head_cross_entropy gathers them for smoothing
                   device=run_device(tc))
    chosen = {key: value for key, value in given.items() if value not in (None, False)}
    return memory.Setup(**{**default, **chosen}).check()


def calculate(cfg: RunConfig, *, tokens: float | None = None, step_time: float | None = None,
              peak_flops: float | None = None, **options) -> dict:
    model = trained_model(cfg)
    setup = setup_from(cfg, **options)
    if setup.ep > 1 and (not model.moe_experts or model.moe_experts % setup.ep or setup.gpus % setup.ep):
        raise QkvError(f"--ep={setup.ep} splits each MoE layer's experts over data-parallel GPUs: it must divide "
                       f"model.moe_experts={model.moe_experts} and --gpus={setup.gpus}")
    if setup.seq > model.max_seq_len and model.positional == "learned":
        raise QkvError(f"--seq={setup.seq} exceeds model.max_seq_len={model.max_seq_len} (learned positions)")
    counts = params.breakdown(model)
    flop_table = flops.table(model, batch=setup.batch, seq=setup.seq)
    mem = memory.training(model, setup)
    weight, grad, master, activation = setup.bytes
    result = {
        "model": {k: v for k, v in asdict(model).items()},
        "setup": asdict(setup),
        "params": counts,
        "flops": {"batch": setup.batch, "seq": setup.seq, "unit": "FLOPs (a multiply-add is 2)",
                  "components": flop_table,
                  "train_per_token": flops.train_flops_per_token(model, setup.seq),
                  "recomputed_with_checkpointing": flops.recomputed(model, batch=setup.batch, seq=setup.seq)
                  if setup.checkpointing else 0},
        "memory": {"bytes_per_param": weight + grad + master + memory.OPTIMIZER_BYTES[setup.optimizer],
                   "bytes": mem},
        "kv_cache_bytes": memory.kv_cache(model, batch=setup.batch, seq=setup.seq,
                                          bytes_per_element=activation),
    }
    if tokens is not None:
        result["compute"] = {"tokens": tokens, "six_nd": flops.six_nd(counts["active"], tokens),
                             "three_forward": flops.train_flops_per_token(model, setup.seq) * tokens}
    if step_time is not None or peak_flops is not None:
        result["mfu"] = _mfu(model, setup, step_time, peak_flops)
    return result


def _mfu(model, setup: memory.Setup, step_time: float | None, peak_flops: float | None) -> dict:
    if step_time is None or peak_flops is None:
        raise QkvError("MFU needs both --step-time SECONDS and --peak-flops FLOPS")
    # one optimizer step: every micro-batch of every accumulation step and pipeline schedule, on every dp rank
    tokens_per_step = setup.batch * setup.seq * setup.gpus * setup.microbatches * setup.accumulation
    tokens_per_s = tokens_per_step / step_time
    return {"step_time": step_time, "peak_flops": peak_flops, "tokens_per_step": tokens_per_step,
            "tokens_per_s": tokens_per_s, "model_flops_per_s": flops.train_flops_per_token(model, setup.seq)
            * tokens_per_s, "mfu": flops.mfu(model, seq=setup.seq, tokens_per_s=tokens_per_s,
                                            peak_flops=peak_flops * setup.gpus)}
