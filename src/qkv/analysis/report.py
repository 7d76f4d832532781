"""Readable text for `qkv calc` and `qkv scaling` (their --json prints the dicts themselves)."""
from __future__ import annotations

SI = ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K"))


def count(n: float) -> str:
    """174604259328 -> '174.60 B' (short scale: B = 1e9)."""
    for scale, suffix in SI:
        if abs(n) >= scale:
            return f"{n / scale:.2f} {suffix}"
    return f"{n:,.0f}"


def nbytes(n: float) -> str:
    """Decimal units, as the notes write them (175B x 2 bytes = 350 GB)."""
    for scale, suffix in ((1e12, "TB"), (1e9, "GB"), (1e6, "MB"), (1e3, "KB")):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {suffix}"
    return f"{n:.0f} B"


def _rows(title: str, rows: list[tuple[str, str]]) -> list[str]:
    width = max(len(name) for name, _ in rows)
    return [title] + [f"  {name:<{width}}  {value:>14}" for name, value in rows] + [""]


def calc_text(r: dict) -> str:
    s, f = r["setup"], r["flops"]
    lines = _rows("parameters", [(k, f"{v:,}") for k, v in r["params"].items()])
    comps = f["components"]
    lines += [f"FLOPs for {f['batch']} x {f['seq']} tokens; {f['unit']}",
              f"  {'component':<34} {'forward':>12} {'backward':>12} {'train':>12}"]
    lines += [f"  {k:<34} {count(v['forward']):>12} {count(v['backward']):>12} {count(v['train']):>12}"
              for k, v in comps.items()]
    lines += [f"  training FLOPs per token: {count(f['train_per_token'])}"]
    if f["recomputed_with_checkpointing"]:
        lines += [f"  + recomputed by activation checkpointing: {count(f['recomputed_with_checkpointing'])} (hardware FLOPs)"]
    lines += [""]
    mem = r["memory"]
    grid = "".join(f", {name} {s[name]}" for name in ("tp", "pp", "ep") if s.get(name, 1) > 1)
    grid += f" ({s['schedule']}, {s['microbatches']} micro-batches)" if s.get("pp", 1) > 1 else ""
    title = (f"training memory per GPU ({s['precision']}, {s['optimizer']}, ZeRO {s['zero']}, {s['gpus']} GPU(s)"
             f"{grid}, micro-batch {s['batch']} x {s['seq']}{', checkpointing' if s['checkpointing'] else ''}; "
             f"{mem['bytes_per_param']} bytes/param before sharding)")
    lines += _rows(title, [(k, nbytes(v)) for k, v in mem["bytes"].items()])[:-1]
    if s["precision"] != "fp32":
        lines += ["  (qkv's layout: fp32 weights and gradients under autocast, the weights being the master copy; "
                  "--layout textbook: 2-byte weights and gradients + an fp32 master)"
                  if s.get("layout", "qkv") == "qkv" else
                  "  (textbook layout: 2-byte weights and gradients + an fp32 master copy; qkv itself trains with "
                  "fp32 weights and gradients under autocast)"]
    if grid:
        lines += ["  (each part for its most loaded rank: tp splits heads, hidden units and T/tp stream positions; "
                  "a pipeline stage holds its micro-batches in flight; expert parallel E / ep of the experts)"]
    lines += [""]
    lines += [f"inference KV cache for {s['batch']} x {s['seq']} tokens: {nbytes(r['kv_cache_bytes'])}", ""]
    if "compute" in r:
        c = r["compute"]
        lines += [f"training compute for {count(c['tokens'])} tokens: 6ND = {c['six_nd']:.3g} FLOPs "
                  f"(3 x forward with attention: {c['three_forward']:.3g})"]
    if "mfu" in r:
        m = r["mfu"]
        lines += [f"MFU: {m['model_flops_per_s']:.3g} model FLOP/s over {s['gpus']} x {m['peak_flops']:.3g} "
                  f"peak = {100 * m['mfu']:.1f}%"]
    return "\n".join(lines).rstrip()


def scaling_text(r: dict) -> str:
    lines = []
    for fit in r["fits"]:
        lines.append(f"{fit['runs']}: L({r['x']}) = {fit['a']:.4g} / {r['x']}^{fit['b']:.4f} + {fit['c']:.4f} "
                     f"({fit['points']} points, rmse {fit['rmse']:.3g})")
    if "plot" in r:
        lines.append(f"plot: {r['plot']}")
    for c in [r["chinchilla"], *r["chinchilla_other_fits"]] if "chinchilla" in r else []:
        lines.append(f"Chinchilla ({c['fit']}) for C = {c['flops']:.3g} FLOPs: N_opt = {count(c['params'])} "
                     f"parameters, D_opt = {count(c['tokens'])} tokens ({c['tokens_per_param']:.1f} tokens/param), "
                     f"loss {c['loss']:.3f}")
    return "\n".join(lines)
