"""Two small records a run keeps in its checkpoints: the last evaluation, and early stopping's.

Each saves and loads itself (`state_dict` / `load_state_dict`), like every other entry of the
training state (checkpoint/state.py)."""

import math

from ..config import EarlyStopConfig
from ..distributed import collectives


class LastEvaluation:
    """The metrics of the latest evaluation and the step they belong to."""

    def __init__(self):
        self.metrics: dict[str, float] = {}
        # -1: no evaluation in this process yet (a resumed run has the checkpoint's metrics, not their step)
        self.step = -1

    def record(self, metrics: dict[str, float], step: int) -> None:
        self.metrics = metrics
        self.step = step

    def state_dict(self) -> dict[str, float]:
        return dict(self.metrics)

    def load_state_dict(self, saved: dict[str, float] | None) -> None:
        self.metrics = dict(saved or {})


class EarlyStop:
    """trainer.early_stop: the best value of the monitored metric, the step it came at, and how
    many evaluations since have not improved on it."""

    def __init__(self, settings: EarlyStopConfig):
        self.settings = settings
        self.best: float | None = None
        self.best_step = 0
        self.bad = 0

    @property
    def stalled(self) -> bool:
        """The monitored metric has not improved for `patience` evaluations."""
        return bool(self.settings.monitor) and self.bad >= self.settings.patience

    def judge(self, metrics: dict[str, float], step: int, is_main: bool) -> None:
        """Rank 0 judges the (global) metric and every rank takes its verdict, so all stop at the
        same step."""
        if not self.settings.monitor:
            return
        value = metrics[self.settings.monitor]
        sign = 1 if self.settings.mode == "max" else -1
        # a NaN or infinite value is never an improvement, and never the best
        finite = math.isfinite(value)
        better = finite and (self.best is None or sign * (value - self.best) > self.settings.min_delta)
        verdict = {**self.state_dict(), "bad": self.bad + 1}
        if better:
            verdict = {"best": value, "step": step, "bad": 0}
        self.load_state_dict(collectives.broadcast_object(verdict if is_main else None))

    def describe(self, step: int) -> str:
        """The line a run that stopped early prints."""
        return (
            f"early stop at step {step}: eval {self.settings.monitor} has not improved on {self.best:.6g} "
            f"(step {self.best_step}) for {self.bad} evaluations (trainer.early_stop.patience)"
        )

    def state_dict(self) -> dict:
        return {"best": self.best, "step": self.best_step, "bad": self.bad}

    def load_state_dict(self, saved: dict | None) -> None:
        """A checkpoint of a run without early stopping has no record: start a fresh one."""
        saved = saved or {"best": None, "step": 0, "bad": 0}
        self.best = saved["best"]
        self.best_step = saved["step"]
        self.bad = saved["bad"]
