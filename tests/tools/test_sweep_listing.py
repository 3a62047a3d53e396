"""A sweep read back from its folder (tools/sweeps.py) in this process: a real Optuna study with a
trial in each state a sweep leaves (finished, pruned, failed, running, interrupted), its rows best
first for either direction, `ddplab runs`' lines and the report's figure. Sweeps that train are
test_sweeps.py's; these are the fast tests the mutation run of the module uses."""

import fcntl
import json
import os
from contextlib import contextmanager
from pathlib import Path

import optuna
import pytest
from optuna.distributions import CategoricalDistribution, FloatDistribution
from optuna.trial import TrialState

from ddplab.errors import DdplabError
from ddplab.tools.sweeps import draw_sweep, find_sweeps, read_sweep, sweep_lines

pytestmark = pytest.mark.timeout(60)
SPACE = {"optim.lr": FloatDistribution(1e-4, 1e-1, log=True), "model.act": CategoricalDistribution(["relu", "tanh"])}


@contextmanager
def _locked(folder):
    """A job's lock on a folder, as a running trial or sweep holds it."""
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, ".lock"), "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


def _sweep(tmp_path, mode="max", trials=6, ends=None):
    """A sweep folder as `ddplab sweep` leaves it: sweep.json and study.db (trials in the order given)."""
    folder = tmp_path / "classifier" / "lr"
    folder.mkdir(parents=True)
    (folder / "sweep.json").write_text(
        json.dumps(
            {
                "experiment": "classifier",
                "space": {"optim.lr": "loguniform(1e-4,1e-1)", "model.act": "choice(relu,tanh)"},
                "monitor": "accuracy",
                "mode": mode,
                "trials": trials,
            }
        )
    )
    direction = "maximize" if mode == "max" else "minimize"
    study = optuna.create_study(study_name="lr", storage=f"sqlite:///{folder}/study.db", direction=direction)
    for lr, act, reports, end in ends or _ENDS:
        study.enqueue_trial({"optim.lr": lr, "model.act": act})
        if end == TrialState.WAITING:
            continue
        trial = study.ask(SPACE)
        for step, value in reports:
            trial.report(value, step)
        if isinstance(end, float):
            study.tell(trial, end)
        elif end is not None:
            study.tell(trial, state=end)
        # None: left running, as by a killed sweep
    return folder


_ENDS = [
    (0.01, "relu", [(10, 0.7), (20, 0.8)], 0.81),
    (0.001, "tanh", [(10, 0.5)], TrialState.PRUNED),
    (0.02, "relu", [(10, 0.9), (20, 0.92)], 0.93),
    (0.05, "tanh", [], TrialState.FAIL),
    # pruned after three reports, its last better than any finished trial's: still after them
    (0.0002, "relu", [(5, 0.2), (10, 0.3), (20, 0.95)], TrialState.PRUNED),
    (0.003, "tanh", [(10, 0.6)], None),
]


def test_rows_are_finished_best_first_then_pruned_by_their_last_value_then_the_rest(tmp_path):
    folder = _sweep(tmp_path)
    sweep, rows = read_sweep(str(folder))
    assert sweep["monitor"] == "accuracy"
    assert [(r["trial"], r["status"], r["value"]) for r in rows] == [
        (2, "finished", 0.93),
        (0, "finished", 0.81),
        (4, "pruned (step 20)", 0.95),
        (1, "pruned (step 10)", 0.5),
        (5, "interrupted", 0.6),
        (3, "failed", None),
    ]
    first = rows[0]
    assert first["run"] == "trial-002" and first["path"] == str(folder / "classifier" / "trial-002")
    assert first["params"] == {"optim.lr": 0.02, "model.act": "relu"} and first["experiment"] == "classifier"
    assert first["reported"] == {"10": 0.9, "20": 0.92}


def test_a_minimized_metric_puts_the_lowest_first(tmp_path):
    folder = _sweep(tmp_path, mode="min")
    _, rows = read_sweep(str(folder))
    assert [r["trial"] for r in rows] == [0, 2, 1, 4, 3, 5]
    assert [r["status"] for r in rows][-2:] == ["failed", "interrupted"]
    # trials that ended in the opposite order are sorted too (the lowest first), not kept as they came
    ends = [
        (0.02, "relu", [(10, 0.9)], 0.93),
        (0.01, "relu", [(10, 0.7)], 0.81),
        (0.001, "tanh", [(10, 0.5)], TrialState.PRUNED),
        (0.0002, "relu", [(10, 0.3)], TrialState.PRUNED),
    ]
    _, rows = read_sweep(str(_sweep(tmp_path / "again", mode="min", ends=ends)))
    assert [(r["trial"], r["value"]) for r in rows] == [(1, 0.81), (0, 0.93), (3, 0.3), (2, 0.5)]


def test_a_trial_whose_run_holds_its_lock_is_running_and_a_pruned_trial_without_reports_is_pruned(tmp_path):
    ends = [(0.01, "relu", [], TrialState.PRUNED), (0.02, "tanh", [], None), (0.03, "relu", [], TrialState.WAITING)]
    folder = _sweep(tmp_path, ends=ends)
    with _locked(folder / "classifier" / "trial-001"):
        _, rows = read_sweep(str(folder))
    assert [(r["trial"], r["status"], r["value"]) for r in rows] == [
        (0, "pruned", None),
        (1, "running", None),
        (2, "waiting", None),
    ]


def test_runs_shows_a_sweep_as_a_heading_and_a_line_per_trial(tmp_path, monkeypatch):
    folder = _sweep(tmp_path)
    monkeypatch.chdir(tmp_path)
    assert sweep_lines(str(folder)) == [
        "sweep classifier/lr: 4 of 6 trials ended, stopped (same command goes on); eval/accuracy (max), best first",
        "  trial      status               accuracy        optim.lr       model.act",
        "  trial-002  finished                 0.93            0.02            relu",
        "  trial-000  finished                 0.81            0.01            relu",
        "  trial-004  pruned (step 20)         0.95          0.0002            relu",
        "  trial-001  pruned (step 10)          0.5           0.001            tanh",
        "  trial-005  interrupted               0.6           0.003            tanh",
        "  trial-003  failed                      -            0.05            tanh",
    ]
    with _locked(folder):
        assert sweep_lines(str(folder))[0].endswith("4 of 6 trials ended, running; eval/accuracy (max), best first")


def test_a_sweep_with_every_trial_ended_is_done_and_a_value_not_finite_is_a_dash(tmp_path, monkeypatch):
    ends = [(1 / 3, "relu", [(5, float("nan"))], TrialState.PRUNED), (0.001234567, "tanh", [], 0.123456)]
    folder = _sweep(tmp_path, trials=2, ends=ends)
    monkeypatch.chdir(tmp_path)
    lines = sweep_lines(str(folder))
    assert lines[0].startswith("sweep classifier/lr: 2 of 2 trials ended, done;")
    assert lines[2:] == [
        "  trial-001  finished               0.1235        0.001235            tanh",
        "  trial-000  pruned (step 5)             -          0.3333            relu",
    ]


def test_a_sweep_continued_with_fewer_trials_than_ended_is_done(tmp_path, monkeypatch):
    folder = _sweep(tmp_path, trials=3)
    monkeypatch.chdir(tmp_path)
    assert sweep_lines(str(folder))[0].startswith("sweep classifier/lr: 4 of 3 trials ended, done;")


def test_sweeps_are_found_in_a_run_folder_or_as_the_folder_itself(tmp_path):
    folder = _sweep(tmp_path)
    (tmp_path / "classifier" / "plain-run").mkdir()
    assert find_sweeps(str(tmp_path)) == [str(folder)]
    assert find_sweeps(str(folder)) == [str(folder)]
    assert find_sweeps(str(tmp_path / "classifier")) == []


@pytest.mark.parametrize("broken", ["no sweep.json", "no study", "bad json"])
def test_a_folder_that_is_not_a_sweep_is_one_line(tmp_path, broken):
    folder = _sweep(tmp_path)
    if broken == "no sweep.json":
        (folder / "sweep.json").unlink()
    elif broken == "no study":
        (folder / "study.db").unlink()
    else:
        (folder / "sweep.json").write_text("{")
    with pytest.raises(DdplabError) as refused:
        read_sweep(str(folder))
    assert refused.value.cause.startswith(f"{folder} is not a readable sweep (")
    assert refused.value.fix == "pass a folder ddplab sweep made"


def test_the_report_draws_the_metric_against_each_searched_key(tmp_path, monkeypatch):
    import matplotlib.pyplot as plt

    folder = _sweep(tmp_path)
    drawn = {}
    monkeypatch.setattr(plt, "close", lambda fig: drawn.setdefault("fig", fig))
    path = draw_sweep(str(folder), str(tmp_path / "report"))
    assert path == str(tmp_path / "report" / "sweep.png") and os.path.getsize(path) > 1000
    lr, act = drawn["fig"].axes
    assert lr.get_xscale() == "log" and act.get_xscale() == "linear"
    assert (lr.get_xlabel(), lr.get_ylabel()) == ("optim.lr", "eval/accuracy")
    assert drawn["fig"]._suptitle.get_text() == "lr: eval/accuracy (max) by searched value"
    # finished trials as dots, pruned ones as crosses at their last value; failed and interrupted not drawn
    finished, pruned = lr.collections
    assert sorted(map(tuple, finished.get_offsets().tolist())) == [(0.01, 0.81), (0.02, 0.93)]
    assert sorted(map(tuple, pruned.get_offsets().tolist())) == [(0.0002, 0.95), (0.001, 0.5)]
    assert [t.get_text() for t in lr.get_legend().get_texts()] == ["finished", "pruned"]
    assert lr.get_legend().get_texts()[0].get_fontsize() == 7
    # a panel 4.2 inches wide per searched key, at 110 dots per inch (the PNG's own header says its size)
    assert tuple(drawn["fig"].get_size_inches()) == pytest.approx((8.4, 3.6))
    header = Path(path).read_bytes()[:24]
    assert (int.from_bytes(header[16:20], "big"), int.from_bytes(header[20:24], "big")) == (924, 396)
    # drawn again into the same folder
    assert draw_sweep(str(folder), str(tmp_path / "report")) == path
