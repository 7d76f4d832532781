"""`qkv train --engine ref`: the NumPy engine's run (qkv.ref.train: forward, hand-written backward,
clipping, schedule and optimizer, no autograd) inside an ordinary run directory.

The torch Trainer of the same config provides what makes the two engines' runs comparable and the result
an ordinary run: the initial weights (the same seed), the same batches, the validation loss and the
checkpoint files. Only the steps are the reference engine's.
"""
from __future__ import annotations

from qkv.errors import QkvError
from qkv.parallel import layout as parallel
from qkv.train.loop import Trainer
from qkv.formats.params import load_numpy, to_numpy
from qkv.ref.train import train_ref
from qkv.train.metrics import MetricsLog


def check_engine(engine: str, *, resume: bool, max_time: float) -> None:
    """--engine ref trains from step 0 for a number of steps: refuse the rest before anything is written."""
    if engine != "ref":
        return
    if resume:
        raise QkvError("--engine ref cannot resume a run; it trains from step 0 in one go")
    if max_time:
        raise QkvError(f"--engine ref takes --max-steps, not a time budget (train.max_time={max_time:g})")
    if parallel.env_world() > 1:
        raise QkvError("--engine ref runs in one process; start it without torchrun")


def run_reference(trainer: Trainer) -> dict:
    """Train with the NumPy engine (hand-written backward passes, no autograd) from the torch engine's
    initial weights and the same batches, then store the result as an ordinary run checkpoint."""
    import time


    tc, state = trainer.tc, trainer.state
    check_engine("ref", resume=state.step > 0, max_time=tc.max_time)  # also when called without the CLI
    params = to_numpy(trainer.model)
    metrics = MetricsLog(trainer.run_dir / "metrics.csv", 0)
    tokens_per_step = tc.batch_size * tc.seq_len
    start = time.perf_counter()

    def batches():
        while True:
            yield trainer.batches.next()

    def on_step(step: int, loss: float, grad_norm: float, lr: float) -> None:
        if (step + 1) % tc.log_every == 0 or step + 1 == tc.max_steps:
            elapsed = time.perf_counter() - start
            metrics.write(step=step + 1, loss=loss, lr=lr, grad_norm=grad_norm,
                          tokens_per_s=(step + 1) * tokens_per_step / elapsed, elapsed_s=elapsed)

    train_ref(params, trainer.cfg, batches(), tc.max_steps, on_step)
    load_numpy(trainer.model, params)
    state.step, state.tokens = tc.max_steps, tc.max_steps * tokens_per_step
    state.elapsed = time.perf_counter() - start
    val = trainer.evaluate()
    metrics.write(step=state.step, val_loss=val, elapsed_s=state.elapsed)
    trainer.save()
    return {"steps": state.step, "tokens": state.tokens, "seconds": round(state.elapsed, 2),
            "tokens_per_s": round(state.tokens / max(1e-9, state.elapsed)), "val_loss": val,
            "best_val_loss": val, "engine": "ref"}
