"""A sweep's trial (launch/trials.py) with its `ddplab run` replaced by a short script that ends the
way a run can end: a best value, pruned, no evaluation, a failure, stopped by a signal. The script
gets the very arguments and environment a trial's run gets, and the study is a real SQLite study.
Trials that train are test_sweeps.py's; these are the fast tests the mutation run of the module
uses (scripts/mutation.py)."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import optuna
import pytest
from optuna.trial import TrialState

from ddplab.errors import DdplabError
from ddplab.launch import trials
from ddplab.launch.space import split_space
from ddplab.launch.sweep import Sweep
from ddplab.train.pruning import SweepTrial

pytestmark = pytest.mark.timeout(60)

# a trial's run: reads its folder from run.dir= and run.name=, ends as SCRIPTED_END says
RUN = textwrap.dedent(
    """
    import json, os, signal, sys, time
    given = dict(a.split("=", 1) for a in sys.argv[1:] if "=" in a)
    folder = os.path.join(given["run.dir"], "classifier", given["run.name"])
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "argv.json"), "w") as f:
        json.dump({"argv": sys.argv[1:], "link": os.environ.get("DDPLAB_SWEEP_TRIAL")}, f)
    end = os.environ["SCRIPTED_END"]
    summary = {"best": {"value": 0.75, "step": 4}, "status": "finished"}
    if end in ("pruned", "pruned_exit1", "killed"):
        summary["status"] = "pruned"
    if end == "early":
        summary["status"] = "stopped early"
    if end == "nobest":
        summary["best"] = None
    if end == "wait":
        got = []
        for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT):
            signal.signal(sig, lambda s, f: got.append(s))
        open(os.path.join(folder, "ready"), "w").close()
        deadline = time.monotonic() + 20
        while not got and time.monotonic() < deadline:
            time.sleep(0.02)
        with open(os.path.join(folder, "received"), "w") as f:
            f.write(" ".join(signal.Signals(s).name for s in got))
        sys.exit(0)
    with open(os.path.join(folder, "summary.json"), "w") as f:
        json.dump(summary, f)
    if end == "killed":
        # killed after its summary was written (an export that ran out of memory)
        os.kill(os.getpid(), signal.SIGKILL)
    sys.exit({"exit1": 1, "pruned_exit1": 1, "term": 143, "int": 130, "usr1": 138}.get(end, 0))
    """
)


@pytest.fixture
def sweep(tmp_path, monkeypatch):
    script = tmp_path / "run.py"
    script.write_text(RUN)
    command = trials._command
    # the trial's arguments as ddplab builds them, given to the script instead of `python -m ddplab run`
    monkeypatch.setattr(
        trials, "_command", lambda *a, **k: [sys.executable, str(script), "--as", *command(*a, **k)[3:]]
    )
    space, _ = split_space(["model.lr=choice(0.1,0.2)", "model.hidden=range(8,17,8)"])
    return Sweep(
        target="tests/fixtures/experiments.py:Classifier",
        experiment="classifier",
        folder=str(tmp_path / "sweep"),
        launch=["-n", "2"],
        settings=["trainer.max_steps=4"],
        space={key: p.text for key, p in space.items()},
        monitor="accuracy",
        mode="max",
        sampler="random",
        pruner="median",
        startup=2,
        seed=0,
        trials=3,
        params=space,
    )


def _study(sweep):
    storage = f"sqlite:///{sweep.folder}/study.db"
    os.makedirs(sweep.folder, exist_ok=True)
    study = optuna.create_study(study_name="sweep", storage=storage, direction="maximize")
    trial = study.ask({key: p.distribution for key, p in sweep.params.items()})
    return study, trial, storage


def _ends(monkeypatch, sweep, end, ended=1):
    monkeypatch.setenv("SCRIPTED_END", end)
    study, trial, storage = _study(sweep)
    code = trials.run_trial(study, trial, sweep, storage, ended)
    return code, study.trials[0], os.path.join(sweep.folder, "classifier", "trial-000")


# a run stopped early by trainer.early_stop finished too, with its best value
@pytest.mark.parametrize("end", ["best", "early"])
def test_a_trial_that_finishes_tells_the_study_its_best_value(sweep, monkeypatch, capsys, end):
    code, trial, folder = _ends(monkeypatch, sweep, end)
    assert code == 0 and trial.state == TrialState.COMPLETE and trial.value == 0.75
    values = f"model.lr={trial.params['model.lr']} model.hidden={trial.params['model.hidden']}"
    assert capsys.readouterr().out == f"sweep: trial 0 (1 of 3 ended): {values}\n"
    given = json.loads(Path(folder, "argv.json").read_text())
    assert given["argv"] == [
        "--as", "run",
        sweep.target, "-n", "2", "trainer.max_steps=4", *values.split(), f"run.dir={sweep.folder}",
        "run.name=trial-000", "checkpoint.monitor=accuracy", "checkpoint.mode=max",
    ]  # fmt: skip
    # the link to the study, whole, for rank 0's pruner
    link = SweepTrial(**json.loads(given["link"]))
    assert link == SweepTrial(
        f"sqlite:///{sweep.folder}/study.db", "sweep", trial._trial_id, 0, "accuracy", "median", 2
    )


def test_a_pruned_trial_is_pruned_in_the_study(sweep, monkeypatch):
    code, trial, _ = _ends(monkeypatch, sweep, "pruned")
    assert code == 0 and trial.state == TrialState.PRUNED


@pytest.mark.parametrize(
    ("end", "why", "fix"),
    [
        ("exit1", "failed (exit code 1)", ""),
        # pruned, then failed (writing its export): a failure
        ("pruned_exit1", "failed (exit code 1)", ""),
        ("killed", "failed (killed by SIGKILL)", ""),
        (
            "nobest",
            "ended without an evaluation of accuracy",
            "; evaluate at each epoch's end or every trainer.eval_every steps",
        ),
    ],
)
def test_a_trial_that_fails_or_never_evaluates_is_one_line_and_not_counted(sweep, monkeypatch, end, why, fix):
    with pytest.raises(DdplabError) as failed:
        _ends(monkeypatch, sweep, end)
    folder = os.path.join(sweep.folder, "classifier", "trial-000")
    assert failed.value.cause == f"trial 0 {why}; its run folder: {folder}"
    assert (
        failed.value.fix == "fix the cause and give the same command: the sweep goes on, this trial not counted" + fix
    )
    assert optuna.load_study(study_name="sweep", storage=f"sqlite:///{sweep.folder}/study.db").trials[0].state == (
        TrialState.FAIL
    )


@pytest.mark.parametrize(
    ("end", "name", "code"), [("term", "SIGTERM", 143), ("int", "SIGINT", 130), ("usr1", "SIGUSR1", 138)]
)
def test_a_run_stopped_by_a_signal_stops_the_sweep_and_says_how_to_continue(
    sweep, monkeypatch, capsys, end, name, code
):
    monkeypatch.setattr(sys, "argv", ["ddplab", "sweep", "x", "--trials", "3"])
    stopped, trial, folder = _ends(monkeypatch, sweep, end)
    assert stopped == code and trial.state == TrialState.RUNNING
    assert capsys.readouterr().err == (
        f"ddplab: sweep stopped by {name}; trial 0 keeps its checkpoints in {folder}. "
        "To continue: ddplab sweep x --trials 3\n"
    )


@pytest.mark.parametrize("sent", [signal.SIGTERM, signal.SIGUSR1, signal.SIGINT])
def test_a_signal_to_the_sweep_reaches_the_trials_run_and_stops_the_sweep(sweep, monkeypatch, sent):
    folder = os.path.join(sweep.folder, "classifier", "trial-000")

    def send_when_ready():
        deadline = time.monotonic() + 20
        # the run has started and the sweep waits for it (its handler is in place)
        while time.monotonic() < deadline and not (
            os.path.exists(os.path.join(folder, "ready")) and signal.getsignal(sent) is not before[sent]
        ):
            time.sleep(0.02)
        os.kill(os.getpid(), sent)
        if sent == signal.SIGINT:
            # Ctrl-C reaches the whole foreground group at once; here only the sweep got it
            time.sleep(0.5)
            with open(os.path.join(os.path.dirname(folder), "pid")) as f:
                os.kill(int(f.read()), signal.SIGINT)

    before = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)}
    popen = subprocess.Popen

    def remember(*args, **kwargs):
        proc = popen(*args, **kwargs)
        os.makedirs(os.path.dirname(folder), exist_ok=True)
        with open(os.path.join(os.path.dirname(folder), "pid"), "w") as f:
            f.write(str(proc.pid))
        return proc

    monkeypatch.setattr(trials.subprocess, "Popen", remember)
    threading.Thread(target=send_when_ready, daemon=True).start()
    code, trial, _ = _ends(monkeypatch, sweep, "wait")
    assert code == 128 + sent.value and trial.state == TrialState.RUNNING
    # SIGTERM and SIGUSR1 are passed on; SIGINT is not (the terminal sends it to the run itself)
    assert Path(folder, "received").read_text() == sent.name
    assert {sig: signal.getsignal(sig) for sig in before} == before


def test_a_trial_a_killed_sweep_left_is_said_to_continue(sweep, monkeypatch, capsys):
    os.makedirs(os.path.join(sweep.folder, "classifier", "trial-000"))
    _ends(monkeypatch, sweep, "best", ended=2)
    assert capsys.readouterr().out.startswith("sweep: trial 0 (continued) (2 of 3 ended): model.lr=")


def test_a_trials_command_carries_config_settings_and_the_shared_mlflow_store(tmp_path):
    sweep = Sweep("t.py:E", "e", "/s", ["-n", "2"], ["a=1"], {}, "loss", "min", "tpe", "none", 0, None, config="c.yaml")
    assert trials._command(sweep, ["k=2"], "trial-001") == [
        sys.executable, "-m", "ddplab", "run", "t.py:E", "-n", "2", "--config", "c.yaml", "a=1", "k=2",
        "run.dir=/s", "run.name=trial-001", "checkpoint.monitor=loss", "checkpoint.mode=min",
    ]  # fmt: skip
    sweep.config, sweep.mlflow_store = None, "sqlite:////s/mlflow.db"
    assert trials._command(sweep, [], "check", "/s/.check")[4:] == [
        "t.py:E", "-n", "2", "a=1", "run.dir=/s/.check", "run.name=check", "checkpoint.monitor=loss",
        "checkpoint.mode=min", "log.mlflow_uri=sqlite:////s/mlflow.db",
    ]  # fmt: skip


CHECK = textwrap.dedent(
    """
    import os, signal, sys
    given = dict(a.split("=", 1) for a in sys.argv[1:] if "=" in a)
    end = os.environ["SCRIPTED_END"]
    if end == "silent":
        # ends before it made its folder
        sys.exit(4)
    os.makedirs(given["run.dir"], exist_ok=True)
    with open(os.path.join(os.path.dirname(given["run.dir"]), "check.argv"), "w") as f:
        f.write(" ".join(sys.argv[1:]))
    if end == "said":
        print("training...")
        said = "checkpoint.monitor='f1' is not a metric (it returns loss); pass checkpoint.monitor=loss"
        print("ddplab: error: " + said, file=sys.stderr)
        sys.exit(2)
    if end == "nofix":
        print("ddplab: error: the dataset is empty", file=sys.stderr)
        sys.exit(2)
    if end == "crash":
        print("Traceback (most recent call last):\\n  File 'x.py', line 1\\nValueError: boom", file=sys.stderr)
        sys.exit(3)
    if end == "sigkill":
        print("training...")
        os.kill(os.getpid(), signal.SIGKILL)
    """
)


@pytest.fixture
def check(sweep, tmp_path, monkeypatch):
    script = tmp_path / "check.py"
    script.write_text(CHECK)
    command = trials._command
    monkeypatch.setattr(
        trials, "_command", lambda *a, **k: [sys.executable, str(script), "--as", *command(*a, **k)[3:]]
    )
    os.makedirs(sweep.folder)
    return sweep


def _check(sweep, monkeypatch, end):
    monkeypatch.setenv("SCRIPTED_END", end)
    try:
        trials.check_first_trial(sweep)
    finally:
        # whatever the end, nothing is kept
        assert not os.path.exists(os.path.join(sweep.folder, ".check"))


def test_the_check_before_the_first_trial_runs_one_step_with_each_spaces_first_value(check, monkeypatch, capsys):
    _check(check, monkeypatch, "ok")
    assert capsys.readouterr().out.startswith("sweep: settings checked (one step and an evaluation, ")
    argv = Path(check.folder, "check.argv").read_text().split()[2:]
    assert argv[:5] == [check.target, "-n", "2", "trainer.max_steps=4", "model.lr=0.1"]
    assert argv[5:9] == [
        "model.hidden=8",
        f"run.dir={check.folder}/.check",
        "run.name=check",
        "checkpoint.monitor=accuracy",
    ]
    assert argv[-len(trials._CHECK_ONLY) :] == trials._CHECK_ONLY


@pytest.mark.parametrize(
    ("end", "cause", "fix"),
    [
        (
            "said",
            "before the first trial: --monitor 'f1' is not a metric (it returns loss)",
            "pass --monitor loss",
        ),
        ("nofix", "before the first trial: the dataset is empty", "fix the settings"),
        ("crash", "the check before the first trial failed (exit code 3): ValueError: boom", "run it alone"),
        ("silent", "the check before the first trial failed (exit code 4): ", "run it alone"),
        ("sigkill", "the check before the first trial failed (killed by SIGKILL): training...", "run it alone"),
    ],
)
def test_a_check_that_fails_is_one_line_naming_its_cause(check, monkeypatch, end, cause, fix):
    with pytest.raises(DdplabError) as failed:
        _check(check, monkeypatch, end)
    assert failed.value.cause == cause
    if fix == "run it alone":
        assert failed.value.fix.startswith(f"run it alone to see why: ddplab run {check.target} -n 2 ")
        assert failed.value.fix.endswith("log.mlflow=false")
    else:
        assert failed.value.fix == fix


def test_a_grid_sweeps_request_to_stop_is_not_an_error_and_other_errors_are(tmp_path):
    study = optuna.create_study(
        sampler=optuna.samplers.GridSampler({"x": [1, 2]}), storage=f"sqlite:///{tmp_path}/s.db"
    )
    for _ in range(2):
        trial = study.ask({"x": optuna.distributions.CategoricalDistribution([1, 2])})
        trials._tell(study, trial.number, 0.5)
    assert [t.state for t in study.trials] == [TrialState.COMPLETE] * 2

    class Locked:
        def tell(self, number, value, state=None):
            raise RuntimeError("database is locked")

    with pytest.raises(RuntimeError, match="database is locked"):
        trials._tell(Locked(), 0, 0.5)


def test_a_trials_run_dies_with_the_sweep_even_killed(tmp_path):
    sweep = subprocess.Popen(
        [
            sys.executable, "-c",
            "import subprocess, sys; from ddplab.launch.trials import _die_with_parent;"
            "p = subprocess.Popen(['sleep', '60'], preexec_fn=_die_with_parent); print(p.pid, flush=True); p.wait()",
        ],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    child = int(sweep.stdout.readline())
    sweep.kill()
    sweep.wait()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and _alive(child):
        time.sleep(0.05)
    assert not _alive(child)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            # a zombie has died; init reaps it
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.parametrize(
    ("code", "said"),
    # a negative code is the signal that killed the run, SIGHUP's -1 too
    [(-9, "killed by SIGKILL"), (-1, "killed by SIGHUP"), (1, "exit code 1"), (137, "exit code 137")],
)
def test_how_a_trials_run_ended_is_said_as_a_user_reads_it(code, said):
    assert trials._exit(code) == said
