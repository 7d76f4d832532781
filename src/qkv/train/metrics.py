"""metrics.csv: one row per logged step, appended as training goes and cut back on resume; optionally the
same scalars as TensorBoard event files (train.tensorboard, when the tensorboard package is installed).

Columns past elapsed_s: batch_size and seq_len (rows and columns used: the batch-size and sequence-length
warmups), skipped and spikes (running counts of skipped non-finite steps and of loss spikes), loss_scale
(fp16 only), aux_loss (MoE only), and DPO's reward_chosen, reward_rejected, reward_margin and reward_accuracy
(qkv.train.dpo; empty for other objectives).
"""
from __future__ import annotations

import csv
import math
from pathlib import Path
from typing import Callable

COLUMNS = ("step", "loss", "val_loss", "lr", "grad_norm", "tokens_per_s", "elapsed_s", "batch_size", "seq_len",
           "skipped", "spikes", "loss_scale", "aux_loss", "flops_per_s", "mfu", "reward_chosen", "reward_rejected",
           "reward_margin", "reward_accuracy")
TENSORBOARD_DIR = "tensorboard"


class MetricsLog:
    def __init__(self, path: Path, resume_step: int):
        self.path = Path(path)
        rows = self.read(self.path) if resume_step and self.path.exists() else []
        kept = [row for row in rows if int(row["step"]) <= resume_step]
        with open(self.path, "w", newline="") as f:  # rows past the checkpoint are replayed, so cut them
            writer = csv.DictWriter(f, COLUMNS)
            writer.writeheader()
            writer.writerows(kept)

    def write(self, **values) -> None:
        row = {key: _fmt(values.get(key)) for key in COLUMNS}
        with open(self.path, "a", newline="") as f:
            csv.DictWriter(f, COLUMNS).writerow(row)

    @staticmethod
    def read(path: Path) -> list[dict[str, str]]:
        with open(path, newline="") as f:
            return list(csv.DictReader(f))


def _fmt(value) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return "" if math.isnan(value) else f"{value:.6g}"
    return str(value)


class TensorBoardLog:
    """The numeric columns of every row as TensorBoard scalars under RUN/tensorboard (tag = column name)."""

    def __init__(self, run_dir: Path, resume_step: int):
        from torch.utils.tensorboard import SummaryWriter  # ImportError without the tensorboard package

        self.writer = SummaryWriter(str(Path(run_dir) / TENSORBOARD_DIR), purge_step=resume_step or None)

    def write(self, **values) -> None:
        step = values["step"]
        for key, value in values.items():
            if key != "step" and isinstance(value, (int, float)) and math.isfinite(value):
                self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


def open_logs(run_dir: Path, resume_step: int, tensorboard: bool, warn: Callable[[str], None]) -> list:
    """metrics.csv, plus the TensorBoard log when asked for and available (else one warning line)."""
    logs: list = [MetricsLog(Path(run_dir) / "metrics.csv", resume_step)]
    if tensorboard:
        try:
            logs.append(TensorBoardLog(run_dir, resume_step))
        except ImportError:
            warn("qkv: warning: train.tensorboard=true but the tensorboard package is not installed "
                 "(pip install tensorboard); writing metrics.csv only")
    return logs
