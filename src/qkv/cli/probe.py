"""`qkv probe`: the numbers of qkv.interp for scripts: the logit lens of a text, and each head's previous-token,
first-token and induction scores."""
from __future__ import annotations

from pathlib import Path

from qkv.cli.options import add_precision, apply_precision, load_for_inference, strict_json
from qkv.errors import QkvError


def add_parsers(sub) -> None:
    probe = sub.add_parser("probe", help="look inside a decoder: the logit lens (--lens) and head scores (--heads) "
                                         "of a text, as a table or --json")
    probe.add_argument("run", help="a qkv run dir, a Hugging Face model dir or a GGUF file (a decoder LM)")
    probe.add_argument("--text", required=True, help="the text to run through the model")
    probe.add_argument("--lens", action="store_true", help="each layer's residual through the final norm and head")
    probe.add_argument("--heads", action="store_true", help="previous-token, first-token and induction scores per head")
    probe.add_argument("--experts", action="store_true", help="a mixture of experts' routing: each layer's chosen "
                                                              "experts and gates per token, and each expert's load")
    probe.add_argument("--attribution", action="store_true",
                       help="each head's, FFN's and the embedding's direct term in the target's logit at the last "
                            "position (Pre-LN decoders)")
    probe.add_argument("--corrupt", metavar="TEXT", help="activation patching: the residual stream of each block and "
                       "position taken from --text into this prompt (as many tokens), and the share of the logit "
                       "difference between the clean and corrupted top tokens it gives back")
    probe.add_argument("--per-head", action="store_true", help="with --corrupt: also each head's output (every "
                       "position) from --text, and the share it gives back (one forward per head)")
    probe.add_argument("--target", help="with --lens / --attribution: the token whose rank each layer gives (default: the model's "
                                        "own top token at the last position)")
    probe.add_argument("--minus", metavar="TEXT", help="with --layer and --out: write the steering vector mean "
                                                       "resid_post(--text) - mean resid_post(--minus) at --layer")
    probe.add_argument("--layer", type=int, help="with --minus: the block whose output the vector is taken from")
    probe.add_argument("--out", help="with --minus: the safetensors file to write the vector to (for qkv generate "
                                     "--steer FILE@LAYER:SCALE)")
    probe.add_argument("--json", action="store_true")
    add_precision(probe)


def cmd_probe(args) -> int:
    import torch

    from safetensors.torch import save_file

    from qkv.interp import (direct_logit_attribution, expert_routes, head_patching_map, head_scores, induction_scores,
                            logit_lens, patching_map, steering_vector)
    from qkv.models.build import architecture_of

    vector = (args.minus, args.layer, args.out)
    if any(v is not None for v in vector) and not all(v is not None for v in vector):
        raise QkvError("a steering vector needs --minus TEXT, --layer N and --out FILE together")
    if not (args.lens or args.heads or args.attribution or args.experts or args.minus is not None
            or args.corrupt is not None):
        raise QkvError("probe: give --lens, --heads, --attribution, --experts or several (or --minus, --layer, --out)")
    if args.out is not None and Path(args.out).exists():
        raise QkvError(f"--out {args.out} exists; not overwriting it")
    if args.per_head and args.corrupt is None:
        raise QkvError("--per-head applies to --corrupt")
    if args.target is not None and not (args.lens or args.attribution):
        raise QkvError("--target applies to --lens and --attribution")
    run = load_for_inference(args)
    if architecture_of(run.model).prompt != "continue" or run.tokenizer is None:
        raise QkvError(f"{args.run}: qkv probe reads decoder-only language models with a tokenizer")
    apply_precision(run, args)
    ids = run.tokenizer.bos_ids + run.tokenizer.encode(args.text)  # (<bos> first where the model's file asks)
    if not ids:
        raise QkvError("--text is empty")
    context = run.config.model.max_seq_len
    ids = torch.tensor([ids[-context:]])
    tokenizer = run.tokenizer
    result: dict = {"tokens": [tokenizer.decode([int(i)]) for i in ids[0]]}
    if args.minus is not None:
        minus = tokenizer.bos_ids + tokenizer.encode(args.minus)
        if not minus:
            raise QkvError("--minus is empty")
        vec = steering_vector(run.model, ids, torch.tensor([minus[-context:]]), args.layer)
        save_file({"vector": vec.contiguous()}, args.out, metadata={"layer": str(args.layer)})
        result["vector"] = {"out": args.out, "layer": args.layer, "norm": float(vec.norm())}
    target = None
    if args.target is not None:
        wanted = tokenizer.encode(args.target)
        if len(wanted) != 1:
            raise QkvError(f"--target {args.target!r} is {len(wanted)} tokens; give one token's text")
        target = wanted[0]
    if args.corrupt is not None:
        corrupt = tokenizer.bos_ids + tokenizer.encode(args.corrupt)
        if len(corrupt) != ids.shape[-1]:
            raise QkvError(f"--corrupt is {len(corrupt)} tokens and --text {ids.shape[-1]}: patching needs prompts "
                           "of one length")
        corrupt = torch.tensor([corrupt])
        with torch.no_grad():
            answer, wrong = int(run.model(ids)[0, -1].argmax()), int(run.model(corrupt)[0, -1].argmax())
        if answer == wrong:
            raise QkvError(f"--text and --corrupt predict the same token ({tokenizer.decode([answer])!r}): nothing to "
                           "recover")
        found = patching_map(run.model, ids, corrupt, answer=answer, wrong=wrong)
        result["patching"] = {**found, "answer": tokenizer.decode([answer]), "wrong": tokenizer.decode([wrong])}
        if args.per_head:
            result["patching"]["heads"] = head_patching_map(run.model, ids, corrupt, answer=answer, wrong=wrong)
    if args.attribution:
        found = direct_logit_attribution(run.model, ids, target=target)
        result["attribution"] = {**found, "target": tokenizer.decode([found["target"]])}
    if args.lens:
        rows = logit_lens(run.model, ids, target=target)
        target = target if target is not None else rows[-1]["top"][0][0]
        result["lens"] = {"target": tokenizer.decode([target]), "layers": [
            {**row, "top": [(tokenizer.decode([i]), p) for i, p in row["top"]]} for row in rows]}
    if args.heads:
        scores = head_scores(run.model, ids)
        result["heads"] = {**scores, "induction": induction_scores(run.model, tokenizer.vocab_size,
                                                                   prefix=[int(ids[0, 0])])}
    if args.experts:
        result["experts"] = expert_routes(run.model, ids)
    print(strict_json(result) if args.json else describe(result))
    return 0


def describe(result: dict) -> str:
    lines = []
    if "vector" in result:
        v = result["vector"]
        lines.append(f"wrote {v['out']}: the steering vector at block {v['layer']} (norm {v['norm']:.3f}); "
                     f"use qkv generate RUN --steer {v['out']}@{v['layer']}:SCALE")
    if "lens" in result:
        lens = result["lens"]
        lines.append(f"logit lens at the last position (target {lens['target']!r}):")
        lines.append(f"  {'layer':<22} {'target rank':>11} {'p(target)':>10}  top tokens")
        for row in lens["layers"]:
            top = ", ".join(f"{t!r} {p:.2f}" for t, p in row["top"][:3])
            lines.append(f"  {row['point']:<22} {row['target_rank']:>11} {row['target_prob']:>10.4f}  {top}")
    if "patching" in result:
        found = result["patching"]
        lines.append(f"patching {found['answer']!r} (clean) against {found['wrong']!r} (corrupted): the share of the "
                     "logit difference each block's input gives back, by position")
        lines.append("  " + " " * 22 + " ".join(f"{t[:6]!r:>8}" for t in result["tokens"]))
        for name, row in zip(found["points"], found["recovered"]):
            lines.append(f"  {name:<22}" + " ".join(f"{v:>8.2f}" for v in row))
        if "heads" in found:
            ranked = sorted(((v, f"{i}.{h}") for i, row in enumerate(found["heads"]) for h, v in enumerate(row)),
                            reverse=True)[:8]
            lines.append("  heads patched one at a time (layer.head share): " + "  ".join(f"{w} {v:.2f}" for v, w in ranked))
    if "attribution" in result:
        found = result["attribution"]
        lines.append(f"direct logit attribution of {found['target']!r} (logit {found['logit']:.3f}; biases "
                     f"{found['constant']:.3f}); the largest terms:")
        for name, term in sorted(found["components"], key=lambda c: -abs(c[1]))[:10]:
            lines.append(f"  {name:<24} {term:>+9.3f}")
    if "heads" in result:
        heads = result["heads"]
        lines.append("the highest-scoring heads (layer.head score):")
        for name in ("previous_token", "first_token", "induction"):
            ranked = sorted(((s, f"{i}.{h}") for i, layer in enumerate(heads[name]) for h, s in enumerate(layer)),
                            reverse=True)[:5]
            lines.append(f"  {name:<15} " + "  ".join(f"{where} {s:.2f}" for s, where in ranked))
    if "experts" in result:
        lines.append("expert routing (each token's experts:gates, largest first; the busiest experts' share of routes):")
        for layer in result["experts"]:
            busiest = sorted(range(len(layer["load"])), key=lambda e: -layer["load"][e])[:4]
            lines.append(f"  {layer['point']}  load " + "  ".join(f"{e}:{layer['load'][e]:.2f}" for e in busiest))
            for token, experts, gates in zip(result["tokens"], layer["experts"], layer["gates"]):
                lines.append(f"    {token!r:<14} " + " ".join(f"{e}:{g:.2f}" for e, g in zip(experts, gates)))
    return "\n".join(lines)


COMMANDS = {"probe": cmd_probe}
