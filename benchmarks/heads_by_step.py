"""The default job's attention heads as it trains: the best previous-token and induction scores (qkv.interp)
every N updates of one `qkv train` run of the shakespeare preset, as a table and a plot.

    python benchmarks/heads_by_step.py [--every 100] [--max-time 300] [--out-dir DIR] [--png heads.png] [--json F]

The scores are taken between updates, in eval mode, and their time is taken off the run's clock, so the run
trains as long as the preset would. Previous-token score: on the first 200 tokens of Hamlet (held out), the
mean weight a query puts on the key just before it; induction score: on 25 random tokens repeated (Olsson et
al. 2022), the mean weight a query of the second copy puts on the key after its twin. Per step: the best head
of each kind (layer.head).
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from qkv.data.corpus import bundled_documents
from qkv.interp import head_scores, induction_scores
from qkv.train import job


def best(scores: list[list[float]]) -> tuple[float, str]:
    return max((s, f"{i}.{h}") for i, layer in enumerate(scores) for h, s in enumerate(layer))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--every", type=int, default=100)
    parser.add_argument("--max-time", type=float, default=300.0)
    parser.add_argument("--out-dir", type=Path)
    parser.add_argument("--png", type=Path)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    out = (args.out_dir or Path(tempfile.mkdtemp(prefix="qkv-heads-"))) / "shakespeare"
    cfg = job.resolve_config(preset="shakespeare", config_file=None, overrides=[], data=[], max_steps=None,
                             max_time=args.max_time, task=None, init=None)
    trainer, cfg = job.start(out, cfg, resume=False, log=print, progress=False)
    tokenizer = trainer.data.tokenizer
    hamlet = next(d.text for d in bundled_documents() if d.id.lower().startswith("hamlet"))
    text_ids = torch.tensor([tokenizer.encode(hamlet[:2000])[:200]])
    rows = []

    def score() -> None:
        start = time.perf_counter()
        model = trainer.model
        model.eval()
        with torch.no_grad():
            previous = best(head_scores(model, text_ids)["previous_token"])
            induction = best(induction_scores(model, tokenizer.vocab_size))
        model.train()
        rows.append({"step": trainer.state.step, "tokens": trainer.state.tokens, "previous_token": previous[0],
                     "previous_head": previous[1], "induction": induction[0], "induction_head": induction[1]})
        print(f"step {rows[-1]['step']:>5}: previous-token {previous[0]:.3f} ({previous[1]}), induction "
              f"{induction[0]:.3f} ({induction[1]})", flush=True)
        spent = time.perf_counter() - start  # off the run's clock (made by run()): the budget is for training
        clock = getattr(trainer, "clock", None)
        if clock is not None:
            clock.session_start += spent
            clock.window_start += spent

    step_once = trainer.train_one

    def train_one(logs, bar) -> None:
        step_once(logs, bar)
        if trainer.state.step % args.every == 0:
            score()

    trainer.train_one = train_one
    score()
    summary = trainer.run()
    score()
    print(json.dumps(summary))
    if args.json:
        args.json.write_text(json.dumps({"summary": summary, "rows": rows}, indent=1))
    if args.png:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 3.5))
        steps = [r["step"] for r in rows]
        ax.plot(steps, [r["previous_token"] for r in rows], label="best previous-token head")
        ax.plot(steps, [r["induction"] for r in rows], label="best induction head")
        ax.set_xlabel("update")
        ax.set_ylabel("score (mean attention weight)")
        ax.set_ylim(0, 1)
        ax.set_title(f"the default job's heads ({summary['steps']} updates, {args.max_time:.0f} s)")
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.png, dpi=110)


if __name__ == "__main__":
    main()
