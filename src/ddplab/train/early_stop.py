"""trainer.early_stop: training stops once the monitored evaluation metric has not improved for
`patience` evaluations in a row, or when a sweep's pruner stops the trial (train/pruning.py).

Rank 0 judges, every rank takes its verdict (one broadcast per evaluation), so every rank stops at
the same step. A checkpoint keeps the record (entry "early_stop"): a resumed run counts on."""

import math

from ..config import EarlyStopConfig
from ..distributed import collectives
from .capability import Capability
from .pruning import SweepTrial


class EarlyStop(Capability):
    """The best value of the monitored metric, the step it came at, and how many evaluations since
    have not improved on it. In a trial of `ddplab sweep` (`trial`), the sweep's pruner may stop the
    run too (train/pruning.py)."""

    state_key = "early_stop"

    def __init__(self, settings: EarlyStopConfig, trial: SweepTrial | None = None, is_main: bool = True):
        self.settings = settings
        self.trial = trial
        self.is_main = is_main
        self.best: float | None = None
        self.best_step = 0
        self.bad = 0
        self.pruned = False

    @property
    def stalled(self) -> bool:
        """The monitored metric has not improved for `patience` evaluations, or the trial was pruned."""
        return self.pruned or (bool(self.settings.monitor) and self.bad >= self.settings.patience)

    def stop_reason(self) -> str | None:
        """How the run ended, as summary.json and `ddplab runs` say it (None: not stopped)."""
        return "pruned" if self.pruned else "stopped early" if self.stalled else None

    def after_evaluation(self, metrics: dict[str, float], step: int) -> None:
        """Rank 0 judges the (global) metric and asks the sweep's pruner; every rank takes its
        verdict, so all stop at the same step."""
        if not (self.settings.monitor or self.trial):
            return
        verdict = None
        if self.is_main:
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

    def closing_line(self, step: int) -> str | None:
        """The line a run that stopped early prints."""
        if not self.stalled:
            return None
        if self.pruned:
            return self.trial.describe(step)
        if self.best is None:
            # every evaluation gave NaN or inf: nothing to improve on
            return (
                f"early stop at step {step}: eval {self.settings.monitor} has not been a finite number in "
                f"{self.bad} evaluations (trainer.early_stop.patience)"
            )
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
