"""The default job on text by other authors, never seen in training, against a char-level nanoGPT trained
for the same time on the same text, both scored the same way.

    python benchmarks/unseen_text.py --nanogpt DIR [--seconds 300] [--qkv-run RUN ...] [--json results.json]

DIR holds nanoGPT's model.py (github.com/karpathy/nanoGPT; not part of qkv). Texts: benchmarks/data/
(Carroll's Alice's Adventures in Wonderland, Milton's Paradise Lost; see benchmarks/data/README.md) and the
preset's own held-out plays.

qkv: `qkv train` (the shakespeare preset, `--max-time SECONDS`) unless --qkv-run names a finished run;
scored by `qkv eval RUN --data FILE` (a sliding window of the model's context, half-context stride).
Peer: nanoGPT's GPT at its README's CPU size (4 layers, 4 heads, 128 wide, no dropout) trained on the
characters of the same training split with its shakespeare_char recipe (AdamW, betas (0.9, 0.99), weight
decay 0.1, 100 warmup steps, cosine to a tenth of the peak, clipping at 1.0), the decay horizon fitted to the
time budget from the first steps' speed. Its defaults are the best of a sweep at 300 s on the held-out plays
(docs/recipe.md): peak rate 6e-3 (its config's 1e-3 gave 2.98 bits/char), 12 sequences of 64 characters (its
CPU README's shape). Scored with the same code as `qkv eval` over characters (a window of its context, half
of it as the stride; the first character, which has no context, is not scored: a slight advantage to the
peer). Run on an otherwise idle machine.
"""
from __future__ import annotations

import argparse
import json
import math
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

DATA = Path(__file__).resolve().parent / "data"
TEXTS = {"Carroll, Alice (prose, 1865)": DATA / "carroll_alice.txt",
         "Milton, Paradise Lost (verse, 1667)": DATA / "milton_paradise_lost.txt"}
HELD_OUT = "held-out plays (Shakespeare)"
WARMUP = 100


def shakespeare_split() -> tuple[str, str]:
    from qkv import presets
    from qkv.data.corpus import join
    from qkv.data.sources import split

    train, held_out = split(presets.get("shakespeare").data)
    return join(train), join(held_out)


def peer_lr(step: int, horizon: int, lr: float) -> float:
    """nanoGPT's schedule: linear warmup, then cosine from lr to lr / 10 at `horizon`."""
    if step < WARMUP:
        return lr * (step + 1) / (WARMUP + 1)
    progress = min(1.0, (step - WARMUP) / max(1, horizon - WARMUP))
    return lr / 10 + 0.5 * (1 + math.cos(math.pi * progress)) * (lr - lr / 10)


def train_peer(nanogpt: Path, text: str, seconds: float, *, lr: float, batch: int, block: int, seed: int = 0):
    sys.path.insert(0, str(nanogpt))
    from model import GPT, GPTConfig  # nanoGPT's own model

    torch.manual_seed(seed)
    chars = sorted(set(text))
    stoi = {c: i for i, c in enumerate(chars)}
    data = torch.tensor([stoi[c] for c in text], dtype=torch.long)
    model = GPT(GPTConfig(block_size=block, vocab_size=len(chars), n_layer=4, n_head=4, n_embd=128, dropout=0.0,
                          bias=True))
    optimizer = model.configure_optimizers(0.1, lr, (0.9, 0.99), "cpu")
    gen = torch.Generator().manual_seed(seed)
    start, step, horizon = time.perf_counter(), 0, None
    while time.perf_counter() - start < seconds:
        if step == 30:  # fit the decay to the budget from the speed of steps 0-29
            horizon = int(seconds / ((time.perf_counter() - start) / 30))
        for group in optimizer.param_groups:
            group["lr"] = peer_lr(step, horizon or 10 ** 9, lr)
        starts = torch.randint(len(data) - block - 1, (batch,), generator=gen)
        x = torch.stack([data[i:i + block] for i in starts])
        y = torch.stack([data[i + 1:i + block + 1] for i in starts])
        _, loss = model(x, y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        step += 1
    return model.eval(), stoi, step, step * batch * block / (time.perf_counter() - start)


class FullLogits(torch.nn.Module):
    """nanoGPT's GPT returns every position's logits only when given targets; qkv's scorer calls model(x)."""

    def __init__(self, gpt):
        super().__init__()
        self.gpt = gpt

    def forward(self, x):
        return self.gpt(x, torch.zeros_like(x))[0]


def peer_bits_per_char(model, stoi: dict, text: str) -> float:
    """qkv eval's own sliding-window scorer (qkv.evaluate.tokens.score_tokens) over the characters."""
    from qkv.evaluate.tokens import score_tokens

    ids = np.array([stoi[c] for c in text], dtype=np.int64)
    block = model.config.block_size
    return score_tokens(FullLogits(model), ids, characters=len(text), seq_len=block, stride=block // 2,
                        device="cpu")["bits_per_char"]


def qkv_bits_per_char(run: Path, path: Path | None) -> float:
    cmd = [sys.executable, "-m", "qkv", "eval", str(run), "--json"] + (["--data", str(path)] if path else [])
    return json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)["bits_per_char"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nanogpt", type=Path, required=True, help="a directory with nanoGPT's model.py")
    parser.add_argument("--seconds", type=float, default=300.0)
    parser.add_argument("--qkv-run", type=Path, nargs="+", help="finished `qkv train` runs of the preset to score")
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--peer-lr", type=float, default=6e-3, help="the peer's peak rate (its shakespeare_char: 1e-3)")
    parser.add_argument("--peer-batch", type=int, default=12, help="sequences per step (its CPU README: 12)")
    parser.add_argument("--peer-block", type=int, default=64, help="its context in characters (its CPU README: 64)")
    parser.add_argument("--held-out-only", action="store_true", help="score the held-out plays only (tuning)")
    args = parser.parse_args()
    torch.set_num_threads(2)
    train_text, held_out = shakespeare_split()
    runs, qkv_info = args.qkv_run, {}
    if not runs:
        runs = [Path(tempfile.mkdtemp(prefix="qkv-unseen-")) / "shakespeare"]
        out = subprocess.run([sys.executable, "-m", "qkv", "train", "--preset", "shakespeare", "--out", str(runs[0]),
                              "--max-time", str(args.seconds), "--quiet", "--no-sample", "--json"],
                             check=True, capture_output=True, text=True).stdout
        qkv_info = json.loads(out.strip().splitlines()[-1])
    model, stoi, steps, tokens_per_s = train_peer(args.nanogpt, train_text, args.seconds, lr=args.peer_lr,
                                                  batch=args.peer_batch, block=args.peer_block)
    rows = []
    for name, path in [(HELD_OUT, None)] + ([] if args.held_out_only else list(TEXTS.items())):
        text = held_out if path is None else path.read_text(encoding="utf-8")
        ours, theirs = [qkv_bits_per_char(run, path) for run in runs], peer_bits_per_char(model, stoi, text)
        rows.append({"text": name, "characters": len(text), "qkv": [round(x, 4) for x in ours],
                     "nanogpt": round(theirs, 4), "gain": [round(theirs - x, 4) for x in ours]})
        print(f"{name:40s} {len(text):>9,} chars  nanoGPT {theirs:.4f}  qkv " +
              "  ".join(f"{x:.4f} ({theirs - x:+.4f})" for x in ours))
    result = {"date": time.strftime("%Y-%m-%d"), "machine": platform.processor() or platform.machine(),
              "torch": torch.__version__, "seconds": args.seconds, "qkv_runs": [str(r) for r in runs],
              "qkv_train": qkv_info, "nanogpt": {"steps": steps, "tokens_per_s": round(tokens_per_s), "lr": args.peer_lr,
                                                                "batch": args.peer_batch, "block": args.peer_block}, "texts": rows}
    print(json.dumps(result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
