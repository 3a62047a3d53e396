"""Two small records a run keeps in its checkpoints: the last evaluation, and early stopping's.

Each saves and loads itself (`state_dict` / `load_state_dict`), like every other entry of the
training state (checkpoint/state.py)."""

import math

from ..config import EarlyStopConfig
from ..distributed import collectives
from .pruning import SweepTrial


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
    many evaluations since have not improved on it. In a trial of `ddplab sweep` (`trial`), the
    sweep's pruner may stop the run too (train/pruning.py)."""

    def __init__(self, settings: EarlyStopConfig, trial: SweepTrial | None = None):
        self.settings = settings
        self.trial = trial
        self.best: float | None = None
        self.best_step = 0
        self.bad = 0
        self.pruned = False

    @property
    def stalled(self) -> bool:
        """The monitored metric has not improved for `patience` evaluations, or the trial was pruned."""
        return self.pruned or (bool(self.settings.monitor) and self.bad >= self.settings.patience)

    @property
    def status(self) -> str:
        """How the run ended, as summary.json and `ddplab runs` say it."""
        return "pruned" if self.pruned else "stopped early" if self.stalled else "finished"

    def judge(self, metrics: dict[str, float], step: int, is_main: bool) -> None:
        """Rank 0 judges the (global) metric and asks the sweep's pruner; every rank takes its
        verdict, so all stop at the same step."""
        if not (self.settings.monitor or self.trial):
            return
        verdict = None
        if is_main:
            verdict = self._improvement(metrics[self.settings.monitor], step) if self.settings.monitor else {}
            verdict = {**self.state_dict(), **verdict}
            verdict["pruned"] = self.trial is not None and self.trial.should_prune(metrics, step)
        self.load_state_dict(collectives.broadcast_object(verdict))

    def _improvement(self, value: float, step: int) -> dict:
        sign = 1 if self.settings.mode == "max" else -1
        # a NaN or infinite value is never an improvement, and never the best
        finite = math.isfinite(value)
        if finite and (self.best is None or sign * (value - self.best) > self.settings.min_delta):
            return {"best": value, "step": step, "bad": 0}
        return {"bad": self.bad + 1}

    def describe(self, step: int) -> str:
        """The line a run that stopped early prints."""
        if self.pruned:
            return self.trial.describe(step)
        return (
            f"early stop at step {step}: eval {self.settings.monitor} has not improved on {self.best:.6g} "
            f"(step {self.best_step}) for {self.bad} evaluations (trainer.early_stop.patience)"
        )

    def state_dict(self) -> dict:
        return {"best": self.best, "step": self.best_step, "bad": self.bad, "pruned": self.pruned}

    def load_state_dict(self, saved: dict | None) -> None:
        """A checkpoint of a run without early stopping has no record: start a fresh one."""
        saved = saved or {"best": None, "step": 0, "bad": 0}
        self.best = saved["best"]
        self.best_step = saved["step"]
        self.bad = saved["bad"]
        # (a checkpoint of an older ddplab has no such field)
        self.pruned = saved.get("pruned", False)
