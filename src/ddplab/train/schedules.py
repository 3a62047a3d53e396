"""Learning-rate schedules: one that knows the run's length (a linear warm-up, then cosine or linear
decay), and when each kind of scheduler steps.

`warmup_schedule` is a plain `LambdaLR`, stepped once per optimizer step and checkpointed like any
scheduler. Build it in `build()` from `self.total_steps`, the run's optimizer steps, the same on
resume (docs/experiments.md). A `ReduceLROnPlateau` steps on a metric instead: after each
evaluation, with the metric the run monitors (`checkpoint.monitor`, else
`trainer.early_stop.monitor`), the same on every rank since evaluation is exact."""

import math

from torch.optim.lr_scheduler import LambdaLR, LRScheduler, ReduceLROnPlateau

from ..errors import ConfigError


def warmup_schedule(optimizer, warmup_steps: int, total_steps: int, decay: str = "cosine", min_factor: float = 0.0):
    """Optimizer step k (from 1) trains at lr x k/warmup_steps while k <= warmup_steps (the first
    step is not wasted at 0), then at lr x a factor going from 1 down to `min_factor` over the
    remaining steps, along half a cosine (decay="cosine") or a straight line (decay="linear")."""
    if not 0 <= warmup_steps < total_steps or decay not in ("cosine", "linear"):
        raise ConfigError(
            f"warmup_schedule cannot warm up {warmup_steps} of {total_steps} steps and decay {decay!r}",
            "use 0 <= warmup_steps < total_steps (self.total_steps), decay cosine or linear",
        )

    def factor(s: int) -> float:
        if s < warmup_steps:
            return (s + 1) / warmup_steps
        p = min(1.0, (s - warmup_steps) / (total_steps - warmup_steps))
        return min_factor + (1 - min_factor) * ((1 + math.cos(math.pi * p)) / 2 if decay == "cosine" else 1 - p)

    return LambdaLR(optimizer, factor)


def per_step(schedulers: list[LRScheduler], monitors: dict[str, str]) -> list[LRScheduler]:
    """The schedulers that step once per optimizer step: all but the plateau ones, which need a
    monitored metric (checked here, before training)."""
    plateau_monitor(schedulers, monitors)
    return [s for s in schedulers if not isinstance(s, ReduceLROnPlateau)]


def plateau_monitor(schedulers: list[LRScheduler], monitors: dict[str, str]) -> str | None:
    """The metric ReduceLROnPlateau schedulers step on (None without one); refused in one line, before
    training, when the run monitors none."""
    if not any(isinstance(s, ReduceLROnPlateau) for s in schedulers):
        return None
    monitor = monitors.get("checkpoint.monitor") or monitors.get("trainer.early_stop.monitor")
    if not monitor:
        raise ConfigError(
            "a ReduceLROnPlateau scheduler steps on an evaluation metric, and the run monitors none",
            "name it: checkpoint.monitor=METRIC (with checkpoint.mode) or trainer.early_stop.monitor=METRIC",
        )
    return monitor


def step_on_evaluation(schedulers: list[LRScheduler], metrics: dict[str, float], monitor: str | None) -> None:
    """After an evaluation: each ReduceLROnPlateau steps with the monitored metric."""
    for scheduler in schedulers:
        if isinstance(scheduler, ReduceLROnPlateau):
            scheduler.step(metrics[monitor])
