"""Training: loss, optimizers, schedules, the loop, checkpoints and metrics."""
