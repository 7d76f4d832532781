"""metrics.csv: one row per logged step, appended as training goes and cut back on resume."""
from __future__ import annotations

import csv
import math
from pathlib import Path

COLUMNS = ("step", "loss", "val_loss", "lr", "grad_norm", "tokens_per_s", "elapsed_s")


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
