"""qkv.train.metrics: metrics.csv rows, cut back to the checkpoint on resume."""
from qkv.train.metrics import MetricsLog


def test_metrics_rows_past_the_checkpoint_are_cut_on_resume(tmp_path):
    path = tmp_path / "metrics.csv"
    log = MetricsLog(path, resume_step=0)
    for step in range(1, 8):
        log.write(step=step, loss=1.0 / step, lr=1e-3, tokens_per_s=100.0)
    log.write(step=7, val_loss=0.5)
    MetricsLog(path, resume_step=4)  # the last checkpoint was at step 4
    rows = MetricsLog.read(path)
    assert [r["step"] for r in rows] == ["1", "2", "3", "4"] and rows[3]["loss"] == "0.25"
    assert rows[0]["val_loss"] == "" and float(rows[0]["tokens_per_s"]) == 100.0
    MetricsLog(path, resume_step=0)  # a resume without a checkpoint starts the log again
    assert MetricsLog.read(path) == []
