"""`ddplab sweep`: every trial a full run of 2 ranks over gloo, pruned on every rank at the same
step, continued after a SIGKILL of the sweep; the study read back with Optuna's own API."""

import json
import os
import shlex
import signal
import time

import optuna
import pytest
from omegaconf import OmegaConf

from ddplab.checkpoint.store import list_checkpoints, load_state
from ddplab.launch.cli import main
from ddplab.train.rundir import is_locked
from helpers import clean_env, ddplab_here, finish, start

EXP = "tests/fixtures/experiments.py:Classifier"
# each process test's timeout covers the waits it passes to the helpers, which never wait past it
QUIET = ["trainer.progress=false", "log.tensorboard=false", "trainer.global_batch_size=32"]


def _study(folder):
    return optuna.load_study(study_name=os.path.basename(folder), storage=f"sqlite:///{folder}/study.db")


def _summary(run):
    with open(os.path.join(run, "summary.json")) as f:
        return json.load(f)


@pytest.mark.parametrize(
    "args, said",
    [
        (["model.lr=choice(0.1,0.2)", "--trials", "0"], "--trials 0: a sweep needs at least one trial"),
        (["model.lr=loguniform(0,1)"], "search space 'model.lr=loguniform(0,1)': loguniform(low,high) needs 0 < low"),
        (["model.lr=interval(0.5,0.1)"], "interval(low,high) needs low < high"),
        (["model.lr=choice()"], "choice() needs at least one value"),
        (["model.lr=range(1,x)"], "range takes numbers"),
        (["model.lr=uniform(0,1)"], "uniform() is not one of choice, range, interval, loguniform"),
        (["model.lrr=choice(0.1,0.2)"], "search space model.lrr=choice(0.1,0.2): unknown config key 'model.lrr'"),
        (["model.hidden=choice(8,wide)"], "search space model.hidden=choice(8,wide)"),
        (["model.lr=choice(0.1)", "model.lr=choice(0.2)"], "model.lr is searched twice"),
        (["trainer.max_steps=4"], "nothing to search"),
        (["model.lr=choice(0.1)", "run.name=x"], "run.name is set by the sweep"),
        (["model.lr=choice(0.1)", "--monitor", "accuracy"], "--monitor accuracy: which way is better?"),
        (["model.lr=choice(0.1)"], "the sweep has no metric to optimize"),
        (["model.lr=interval(0.1,0.2)", "--sampler", "grid", "--monitor", "loss", "--mode", "min"], "--sampler grid"),
        (
            ["model.lr=choice(0.1)", "--nnodes", "2", "--monitor", "loss", "--mode", "min"],
            "runs its trials on this node",
        ),
    ],
)
def test_a_malformed_sweep_is_one_line_before_anything_starts(tmp_path, capsys, args, said):
    # in this process: the command is checked before any process starts
    code = main(["sweep", EXP, f"run.dir={tmp_path}", *args])
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and said in lines[0], err
    # nothing was made: no sweep folder, no trial
    assert not list(tmp_path.iterdir())


@pytest.mark.timeout(120)
@pytest.mark.slow
def test_a_metric_the_experiment_never_returns_is_one_line_before_the_first_trial(tmp_path):
    res = ddplab_here(
        "sweep", EXP, "-n", "2", f"run.dir={tmp_path}", *QUIET, "model.lr=choice(0.1,0.2)", "--monitor", "f1",
        "--mode", "max",
    )  # fmt: skip
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2 and len(lines) == 1, res.stderr
    assert "before the first trial: --monitor 'f1' is not a metric the evaluation returns" in lines[0]
    assert "pass --monitor <one of those>" in lines[0]
    sweep = tmp_path / "classifier" / "sweep-lr"
    # the check ran in a folder it removed; no trial was asked for
    assert not (sweep / ".check").exists() and not (sweep / "classifier").exists()
    assert _study(str(sweep)).trials == []


@pytest.mark.slow
@pytest.mark.timeout(360)
def test_a_sweep_prunes_on_every_rank_groups_its_trials_and_its_best_trains_again_the_same(tmp_path):
    """lr 0 never learns: after a trial that does, the median pruner stops every such trial at its
    first evaluation, on both ranks (a rank left behind would hang in a collective)."""
    args = [
        "sweep", EXP, "-n", "2", f"run.dir={tmp_path}", *QUIET, "trainer.max_epochs=3",
        "model.lr=choice(0.2,0.0)", "model.hidden=range(8,20,4)", "--monitor", "loss", "--mode", "min",
        "--trials", "4", "--sampler", "random", "--seed", "3", "--pruner-startup", "1",
    ]  # fmt: skip
    res = ddplab_here(*args)
    assert res.returncode == 0, res.stdout + res.stderr
    folder = tmp_path / "classifier" / "sweep-lr-hidden"
    study = _study(str(folder))
    trials = study.trials
    assert len(trials) == 4
    states = [t.state for t in trials]
    assert optuna.trial.TrialState.PRUNED in states, states
    full_steps = 3 * 512 // 32
    for t in trials:
        run = folder / "classifier" / f"trial-{t.number:03d}"
        cfg = OmegaConf.load(run / "config.yaml")
        # the trial's values reached the run as its settings
        assert cfg.model.lr == t.params["model.lr"] and cfg.model.hidden == t.params["model.hidden"]
        ended = _summary(run)
        steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
        if t.state == optuna.trial.TrialState.PRUNED:
            # pruned at an evaluation, every rank at once: the run ended there, cleanly
            step = max(t.intermediate_values)
            assert ended["status"] == "pruned" and max(steps) == step < full_steps
            # its last checkpoint says so, and loads as any (plain types only)
            last = list_checkpoints(str(run / "checkpoints"))[-1]
            assert last.step == step and load_state(last.path)["early_stop"]["pruned"] is True
            done = [d for d in trials if d.state == optuna.trial.TrialState.COMPLETE and d.number < t.number]
            assert t.params["model.lr"] == 0.0 and done
            assert t.intermediate_values[step] > sorted(d.intermediate_values[step] for d in done)[(len(done) - 1) // 2]
        else:
            assert t.state == optuna.trial.TrialState.COMPLETE and ended["status"] == "finished"
            assert max(steps) == full_steps and t.value == ended["best"]["value"]
    best = study.best_trial
    assert f"best: trial {best.number}, eval/loss {best.value:.6g}" in res.stdout

    # ddplab runs: the group, best first
    listed = ddplab_here("runs", str(tmp_path))
    rows = [line.split() for line in listed.stdout.splitlines() if line.strip().startswith("trial-")]
    assert rows[0][0] == f"trial-{best.number:03d}" and len(rows) == 4, listed.stdout
    finished = [float(r[2]) for r in rows if r[1] == "finished"]
    assert finished == sorted(finished) and rows[-1][1] == "pruned"
    rows = [row for row in json.loads(ddplab_here("runs", str(tmp_path), "--json").stdout) if "sweep" in row]
    assert {r["trial"]: r["params"] for r in rows} == {t.number: t.params for t in trials}
    assert {r["trial"]: r["reported"] for r in rows} == {
        t.number: {str(k): v for k, v in t.intermediate_values.items()} for t in trials
    }
    drawn = ddplab_here("report", str(folder))
    assert drawn.returncode == 0 and (folder / "report" / "sweep.png").stat().st_size > 10_000

    # the printed command trains the best trial again, to the same value
    command = shlex.split(res.stdout.split("to train it again: ")[1].splitlines()[0])
    again = ddplab_here(*command[1:], f"run.dir={tmp_path / 'again'}", "run.name=best")
    assert again.returncode == 0, again.stderr
    assert _summary(tmp_path / "again" / "classifier" / "best")["best"]["value"] == best.value


def _wait_for_checkpoint_after(run, step, proc, limit_s=150):
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline and proc.poll() is None:
        saved = list_checkpoints(str(run / "checkpoints"))
        if saved and saved[-1].step > step:
            return saved[-1].step
        time.sleep(0.2)
    raise AssertionError(f"no checkpoint after step {step} in {run}")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_killed_or_stopped_sweep_continues_its_trial_from_its_checkpoint_and_reruns_nothing(tmp_path):
    args = [
        "sweep", EXP, "-n", "2", f"run.dir={tmp_path}", *QUIET, "trainer.max_steps=30",
        "trainer.checkpoint_every=4", "trainer.eval_every=10", "fault.step_sleep=0.1",
        "model.hidden=choice(8,16)", "--monitor", "loss", "--mode", "min", "--trials", "2", "--sampler", "grid",
    ]  # fmt: skip
    proc = start(*args)
    second = tmp_path / "classifier" / "sweep-hidden" / "classifier" / "trial-001"
    _wait_for_checkpoint_after(second, 4, proc)
    first = second.parent / "trial-000"
    finished_first = (first / "metrics.jsonl").read_text()
    proc.send_signal(signal.SIGKILL)
    finish(proc, timeout=30)
    # the trial's job died with the sweep: its run folder is let go at once
    deadline = time.monotonic() + 20
    while is_locked(str(second)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not is_locked(str(second))
    killed_at = list_checkpoints(str(second / "checkpoints"))[-1].step
    assert 4 < killed_at < 30

    res = ddplab_here(*[a for a in args if a != "fault.step_sleep=0.1"], "fault.step_sleep=0")
    assert res.returncode == 2 and "holds another sweep (its settings differ" in res.stderr, res.stderr

    # continued, then stopped by SIGTERM: passed on to the trial's run, which saves where it is
    proc = start(*args)
    _wait_for_checkpoint_after(second, killed_at, proc)
    proc.send_signal(signal.SIGTERM)
    code, out, err = finish(proc, timeout=60)
    assert code == 128 + signal.SIGTERM, err
    assert f"resumed from {second / 'checkpoints'}" in out and f"at step {killed_at} " in out
    said = err.strip().splitlines()[-1]
    assert said.startswith("ddplab: sweep stopped by SIGTERM; trial 1 keeps its checkpoints"), err
    continue_with = shlex.split(said.split("To continue: ")[1])
    stopped_at = list_checkpoints(str(second / "checkpoints"))[-1].step
    assert killed_at < stopped_at < 30

    res = ddplab_here(*continue_with[1:])
    assert res.returncode == 0, res.stdout + res.stderr
    assert "sweep: trial 1 (continued)" in res.stdout and "sweep: trial 0" not in res.stdout
    assert f"at step {stopped_at} " in res.stdout
    # the finished trial was not run again
    assert (first / "metrics.jsonl").read_text() == finished_first
    states = [t.state for t in _study(str(second.parents[1])).trials]
    assert states == [optuna.trial.TrialState.COMPLETE] * 2


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_a_failed_trial_stops_the_sweep_in_one_line_and_is_not_counted(tmp_path):
    """As Optuna stops on an exception: the trial raises at step 3 (after the one-step check). One
    process a trial: what is checked is the sweep's, not the ranks'."""
    args = [
        "sweep", EXP, f"run.dir={tmp_path}", *QUIET, "trainer.max_steps=6", "fault.raise_at_step=3",
        "model.hidden=choice(8,16)", "--monitor", "loss", "--mode", "min", "--trials", "1",
    ]  # fmt: skip
    for attempt in range(2):
        res = ddplab_here(*args)
        said = res.stderr.strip().splitlines()[-1]
        run = tmp_path / "classifier" / "sweep-hidden" / "classifier" / f"trial-{attempt:03d}"
        assert res.returncode == 2 and said.startswith(f"ddplab: error: trial {attempt} failed (exit code 1)"), (
            res.stderr
        )
        assert f"its run folder: {run}; fix the cause and give the same command" in said
        # a failed trial is not one of the --trials: the next attempt is trial 1 of "0 ended"
        assert f"sweep: trial {attempt} (0 of 1 ended)" in res.stdout
    states = [t.state for t in _study(str(run.parents[1])).trials]
    assert states == [optuna.trial.TrialState.FAIL] * 2


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_grid_sweep_tries_each_point_once_and_ends(tmp_path):
    """One process per trial; --trials above the grid's size is cut to it."""
    args = [
        "sweep", EXP, f"run.dir={tmp_path}", *QUIET, "trainer.max_epochs=1", "model.lr=choice(0.2,0.0)",
        "model.hidden=range(8,20,8)", "--monitor", "accuracy", "--mode", "max", "--trials", "9", "--sampler", "grid",
    ]  # fmt: skip
    res = ddplab_here(*args)
    assert res.returncode == 0, res.stdout + res.stderr
    study = _study(str(tmp_path / "classifier" / "sweep-lr-hidden"))
    points = {(t.params["model.lr"], t.params["model.hidden"]) for t in study.trials}
    assert len(study.trials) == 4 and points == {(0.2, 8), (0.2, 16), (0.0, 8), (0.0, 16)}
    assert all(t.state == optuna.trial.TrialState.COMPLETE for t in study.trials)
    assert study.best_trial.params["model.lr"] == 0.2 and "best: trial" in res.stdout


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_grid_point_that_failed_is_tried_again_when_the_sweep_continues_and_no_point_twice(tmp_path):
    """Optuna's grid counts a failed point as visited: the continued sweep trained the other point a
    second time and said "2 trials finished". The trial (one process) raises at step 3 of the point
    raise_at_step=3 until FIXTURE_FIXED is set (the fix), whichever order the grid takes."""
    args = [
        "sweep", EXP, f"run.dir={tmp_path}", *QUIET, "trainer.max_steps=4", "trainer.eval_every=4",
        "fault.fixed_by_env=FIXTURE_FIXED", "fault.raise_at_step=choice(0,3)", "--monitor", "loss", "--mode", "min",
        "--sampler", "grid",
    ]  # fmt: skip
    res = ddplab_here(*args)
    assert res.returncode == 2 and "failed (exit code 1)" in res.stderr, res.stdout + res.stderr
    res = ddplab_here(*args, env={**clean_env(), "FIXTURE_FIXED": "1"})
    assert res.returncode == 0, res.stdout + res.stderr
    study = _study(str(tmp_path / "classifier" / "sweep-raise_at_step"))
    states = {}
    for trial in study.trials:
        states.setdefault(trial.params["fault.raise_at_step"], []).append(trial.state.name)
    # each point finished once; the failed one was not replaced by the other point
    assert {point: runs.count("COMPLETE") for point, runs in states.items()} == {0: 1, 3: 1}
    assert states[3].count("FAIL") == 1 and "FAIL" not in states[0]
    failed = next(t.number for t in study.trials if t.state.name == "FAIL")
    assert f"2 trials finished, 0 pruned, 1 failed (trial {failed}: each point tried again)" in res.stdout
