"""A trial of `ddplab sweep` reports its evaluations to the sweep's Optuna study, whose pruner may
stop it early.

Only rank 0 talks to the study: it reports the monitored metric at each evaluation and asks the
pruner, and every rank takes its verdict with early stopping's (early_stop.EarlyStop), so a pruned
trial ends on every rank at the same step, and no rank is left waiting in a collective."""

import json
import math
import os
import warnings
from dataclasses import dataclass

from .. import environment

PRUNERS = ("median", "halving", "hyperband", "none")


def make_pruner(name: str, startup: int):
    """Optuna's pruner called `name` (PRUNERS); `startup`: trials the median pruner lets run in
    full before it compares (it needs finished trials to compare with)."""
    import optuna

    if name == "median":
        return optuna.pruners.MedianPruner(n_startup_trials=startup)
    if name == "halving":
        return optuna.pruners.SuccessiveHalvingPruner()
    if name == "hyperband":
        return optuna.pruners.HyperbandPruner()
    return optuna.pruners.NopPruner()


def quiet_optuna() -> None:
    """Optuna's own INFO lines (a study created, a trial finished) repeat what ddplab says."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)


@dataclass
class SweepTrial:
    """The study and trial this run belongs to, as the sweep set them (environment.SWEEP_TRIAL)."""

    storage: str  # sqlite:///SWEEP/study.db
    study: str
    trial_id: int
    number: int
    monitor: str  # the metric the sweep optimizes and the pruner judges
    pruner: str
    startup: int

    @classmethod
    def from_env(cls) -> "SweepTrial | None":
        text = os.environ.get(environment.SWEEP_TRIAL)
        return cls(**json.loads(text)) if text else None

    def to_env(self, env: dict) -> dict:
        return {**env, environment.SWEEP_TRIAL: json.dumps(self.__dict__)}

    def should_prune(self, metrics: dict[str, float], step: int) -> bool:
        """Rank 0 only: report this evaluation's monitored metric at `step`; the pruner's verdict."""
        import optuna

        quiet_optuna()
        if getattr(self, "_trial", None) is None:
            study = optuna.load_study(
                study_name=self.study, storage=self.storage, pruner=make_pruner(self.pruner, self.startup)
            )
            self._trial = optuna.trial.Trial(study, self.trial_id)
        value = metrics[self.monitor]
        with warnings.catch_warnings():
            # a resumed trial reports again the steps it reported before it was killed (kept
            # once), and numpy warns of a trial whose values are all NaN (pruned)
            warnings.simplefilter("ignore")
            self._trial.report(value if math.isfinite(value) else float("nan"), step)
            # (numpy's bool from some pruners: a checkpoint holds only plain types)
            return bool(self._trial.should_prune())

    def describe(self, step: int) -> str:
        """The line a pruned trial prints."""
        return (
            f"trial {self.number} pruned at step {step}: its eval {self.monitor} is worse than the sweep's "
            f"other trials had at this step ({self.pruner} pruner)"
        )
