"""trainer.early_stop (train/early_stop.py) in this process: the count of evaluations without
improvement, its boundary (min_delta, patience), the line and status a stopped run ends with, a
sweep's pruning verdict, its checkpoint entry, and the loop stopping at the step it says. Its
agreement across real ranks is test_step_effects.py's; NaN values are test_nonfinite_monitor.py's."""

import pytest

from ddplab.config import EarlyStopConfig
from ddplab.train.early_stop import EarlyStop
from helpers import summary_of
from test_loop_reference import Regression, config

pytestmark = pytest.mark.timeout(60)


def _judged(stop: EarlyStop, values: list[float], first: int = 1) -> EarlyStop:
    """`values` as the monitored loss of evaluations at steps first, first + 1, ..."""
    for step, value in enumerate(values, start=first):
        stop.after_evaluation({"loss": value}, step)
    return stop


def test_the_run_stops_after_patience_evaluations_without_improvement_and_says_so():
    stop = _judged(EarlyStop(EarlyStopConfig(monitor="loss", mode="min", patience=2)), [0.5, 0.4, 0.45])
    assert (stop.best, stop.best_step, stop.bad) == (0.4, 2, 1)
    assert stop.stop_reason() is None and stop.closing_line(3) is None
    _judged(stop, [0.41], first=4)
    assert stop.stop_reason() == "stopped early"
    assert stop.closing_line(4) == (
        "early stop at step 4: eval loss has not improved on 0.4 (step 2) for 2 evaluations "
        "(trainer.early_stop.patience)"
    )


def test_an_improvement_must_be_larger_than_min_delta():
    settings = EarlyStopConfig(monitor="loss", mode="max", patience=5, min_delta=0.25)
    # 0.25 up is not more than min_delta; 0.5 up is
    stop = _judged(EarlyStop(settings), [1.0, 1.25, 1.5])
    assert (stop.best, stop.best_step, stop.bad) == (1.5, 3, 0)
    stop = _judged(EarlyStop(settings), [1.0, 1.25])
    assert (stop.best, stop.bad) == (1.0, 1)


def test_in_min_mode_an_improvement_must_be_larger_than_min_delta_too():
    settings = EarlyStopConfig(monitor="loss", mode="min", patience=5, min_delta=0.25)
    # 0.25 down is not more than min_delta; 0.5 down is
    stop = _judged(EarlyStop(settings), [1.0, 0.75])
    assert (stop.best, stop.best_step, stop.bad) == (1.0, 1, 1)
    _judged(stop, [0.5], first=3)
    assert (stop.best, stop.best_step, stop.bad) == (0.5, 3, 0)


def test_a_mode_read_from_a_config_file_counts_as_the_literal_does():
    """A mode parsed from YAML or the command line is a string of its own, not the interned literal."""
    mode = "".join(["ma", "x"])
    stop = _judged(EarlyStop(EarlyStopConfig(monitor="loss", mode=mode, patience=5)), [1.0, 2.0])
    assert (stop.best, stop.best_step) == (2.0, 2)


def test_a_metric_that_was_never_finite_stops_the_run_with_a_line_that_says_so():
    stop = _judged(EarlyStop(EarlyStopConfig(monitor="loss", patience=2)), [float("nan"), float("inf")])
    assert stop.best is None and stop.stop_reason() == "stopped early"
    assert stop.closing_line(2) == (
        "early stop at step 2: eval loss has not been a finite number in 2 evaluations (trainer.early_stop.patience)"
    )


def test_without_a_monitor_nothing_is_judged_and_nothing_stops():
    stop = _judged(EarlyStop(EarlyStopConfig(monitor="", patience=1)), [3.0, 2.0, 1.0])
    assert stop.best is None and stop.bad == 0 and stop.stop_reason() is None


class Trial:
    """A sweep's trial as EarlyStop sees it (train/pruning.py's SweepTrial): asked at each evaluation."""

    def __init__(self, prune_at: int):
        self.prune_at = prune_at
        self.asked = []

    def should_prune(self, metrics, step):
        self.asked.append(step)
        return step >= self.prune_at

    def describe(self, step):
        return f"pruned at step {step}"


def test_a_sweeps_pruner_stops_the_trial_even_without_a_monitor():
    trial = Trial(prune_at=3)
    stop = _judged(EarlyStop(EarlyStopConfig(monitor=""), trial), [1.0, 1.0])
    assert trial.asked == [1, 2] and stop.stop_reason() is None
    _judged(stop, [1.0], first=3)
    assert stop.stop_reason() == "pruned" and stop.closing_line(3) == "pruned at step 3"


def test_its_record_is_saved_and_restored_and_an_older_checkpoint_starts_a_fresh_one():
    settings = EarlyStopConfig(monitor="loss", patience=3)
    stop = _judged(EarlyStop(settings), [0.5, 0.6, 0.7])
    saved = stop.state_dict()
    assert saved == {"best": 0.5, "step": 1, "bad": 2, "pruned": False}
    resumed = EarlyStop(settings)
    resumed.load_state_dict(saved)
    assert _judged(resumed, [0.8], first=4).stop_reason() == "stopped early"
    fresh = EarlyStop(settings)
    fresh.load_state_dict(None)
    assert (fresh.best, fresh.best_step, fresh.bad, fresh.pruned) == (None, 0, 0, False)
    assert EarlyStop(settings).state_dict() == {"best": None, "step": 0, "bad": 0, "pruned": False}
    # a checkpoint of a ddplab before pruning has no such field
    fresh.load_state_dict({"best": 0.5, "step": 1, "bad": 0})
    assert fresh.pruned is False


def test_the_loop_stops_at_the_step_early_stopping_says_and_the_summary_says_why(tmp_path, capsys):
    exp = Regression(
        config(
            tmp_path,
            "trainer.max_steps=10",
            "trainer.eval_every=1",
            "trainer.early_stop.monitor=loss",
            "trainer.early_stop.patience=2",
            # no evaluation after the first improves on it by that much
            "trainer.early_stop.min_delta=1e9",
        )
    )
    exp.fit()
    assert exp.step == 3
    assert summary_of(exp.run_dir)["status"] == "stopped early"
    assert "early stop at step 3: eval loss has not improved on" in capsys.readouterr().out
