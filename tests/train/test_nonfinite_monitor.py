"""A non-finite monitored value is never "best" and never "an improvement": a NaN at the first
evaluation must not become the best checkpoint forever (keep-best would prune the real best) nor
make early stopping stop while the metric improves."""

import math

from ddplab.checkpoint.store import CheckpointManager
from ddplab.config import EarlyStopConfig
from ddplab.train.early_stop import EarlyStop


def test_a_nan_first_evaluation_does_not_stop_a_run_that_improves():
    stop = EarlyStop(EarlyStopConfig(monitor="loss", mode="min", patience=2))
    for step, loss in enumerate([math.nan, 0.9, 0.8, 0.7], start=1):
        stop.after_evaluation({"loss": loss}, step)
    assert stop.best == 0.7 and stop.best_step == 4 and stop.bad == 0 and not stop.stalled


def test_non_finite_values_count_as_evaluations_without_improvement():
    stop = EarlyStop(EarlyStopConfig(monitor="accuracy", mode="max", patience=2))
    for step, accuracy in enumerate([0.5, math.inf, math.nan], start=1):
        stop.after_evaluation({"accuracy": accuracy}, step)
    assert stop.best == 0.5 and stop.bad == 2 and stop.stalled


def test_a_checkpoint_with_a_nan_metric_is_never_the_best(tmp_path):
    manager = CheckpointManager(str(tmp_path), keep_last=1, keep_best=1, monitor="loss", mode="min")
    for step, loss in ((1, math.nan), (2, 0.5), (3, 0.9)):
        manager.save({"step": step}, step, 0, loss)
    assert [info.step for info in manager.best()] == [2]
    # kept: the best (step 2) and the last (step 3); the NaN one pruned
    assert [info.step for info in manager.list()] == [2, 3]
