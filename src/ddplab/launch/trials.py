"""One trial of `ddplab sweep` as a `ddplab run` of its own, and the short run that checks the
sweep's settings before the first trial.

A trial's run is a child process that dies with the sweep (even killed), so a killed sweep leaves
no job behind, only the trial's checkpoints; a signal to the sweep reaches the trial's run, which
saves and stops as any run does, and the sweep stops after it."""

import ctypes
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time

from ..errors import DdplabError
from ..train.pruning import SweepTrial
from ..train.rundir import read_json
from .space import as_setting

SAMPLERS = ("tpe", "random", "grid")
# the signals a sweep passes on to the run of its trial (Ctrl-C reaches it without help)
_PASSED_ON = (signal.SIGTERM, signal.SIGUSR1)
# what the check before the first trial turns off: it trains one step, evaluates, and keeps nothing
_CHECK_ONLY = [
    "trainer.max_steps=1",
    "trainer.eval_every=1",
    "trainer.checkpoint_every=0",
    "trainer.progress=false",
    "trainer.profile=",
    "trainer.early_stop.monitor=",
    "checkpoint.at_end=false",
    "checkpoint.every_epoch=false",
    "checkpoint.keep_best=0",
    "log.tensorboard=false",
    "log.wandb=false",
    "log.mlflow=false",
]


def run_trial(study, trial, sweep, storage: str, ended: int) -> int:
    """Run one trial (a new one, or one a killed sweep left running; `ended` trials before it) and
    tell the study how it ended; returns 0 to go on, else the sweep's exit code."""
    from optuna.trial import TrialState

    name = f"trial-{trial.number:03d}"
    values = [as_setting(key, trial.params[key]) for key in sweep.space]
    run_dir = os.path.join(sweep.folder, sweep.experiment, name)
    again = " (continued)" if os.path.isdir(run_dir) else ""
    print(f"sweep: trial {trial.number}{again} ({ended} of {sweep.trials} ended): {' '.join(values)}", flush=True)
    link = SweepTrial(
        storage, study.study_name, trial._trial_id, trial.number, sweep.monitor, sweep.pruner, sweep.startup
    )
    code, stopped_by = _run(_command(sweep, values, name), link.to_env(dict(os.environ)))
    if stopped_by or code in (128 + signal.SIGINT, 128 + signal.SIGTERM, 128 + signal.SIGUSR1):
        stop = signal.Signals(stopped_by or code - 128)
        print(
            f"ddplab: sweep stopped by {stop.name}; trial {trial.number} keeps its checkpoints in {run_dir}. "
            f"To continue: {shlex.join(['ddplab', *sys.argv[1:]])}",
            file=sys.stderr,
            flush=True,
        )
        return 128 + stop.value
    summary = read_json(os.path.join(run_dir, "summary.json"))
    if code == 0 and summary.get("status") == "pruned":
        _tell(study, trial.number, state=TrialState.PRUNED)
        return 0
    if code == 0 and summary.get("best"):
        _tell(study, trial.number, summary["best"]["value"])
        return 0
    _tell(study, trial.number, state=TrialState.FAIL)
    why = f"failed ({_exit(code)})" if code else f"ended without an evaluation of {sweep.monitor}"
    raise DdplabError(
        f"trial {trial.number} {why}; its run folder: {run_dir}",
        "fix the cause and give the same command: the sweep goes on, this trial not counted"
        + ("" if code else "; evaluate at each epoch's end or every trainer.eval_every steps"),
    )


def _exit(code: int) -> str:
    """How a process ended, as a user reads it (the kernel's out-of-memory killer sends SIGKILL)."""
    return f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"


def _tell(study, number: int, value: float | None = None, state=None) -> None:
    """Tell the study how a trial ended. Optuna's GridSampler asks the study to stop after the
    grid's last point, which only `optimize()` may do; the trial is stored by then, and the sweep
    ends by its own count."""
    try:
        study.tell(number, value, state=state)
    except RuntimeError as e:
        if "Study.stop" not in str(e):
            raise


def check_first_trial(sweep) -> None:
    """Before the first trial: one step and one evaluation with the first value of each searched
    key, in a folder removed after. A setting no run accepts, or a monitored metric the evaluation
    never returns, is then one line here instead of a failed trial."""
    values = [as_setting(key, p.first()) for key, p in sweep.params.items()]
    folder = os.path.join(sweep.folder, ".check")
    started = time.monotonic()
    command = [*_command(sweep, values, "check", folder), *_CHECK_ONLY]
    try:
        done = subprocess.run(command, capture_output=True, text=True, preexec_fn=_die_with_parent)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    if done.returncode == 0:
        print(f"sweep: settings checked (one step and an evaluation, {time.monotonic() - started:.0f} s)", flush=True)
        return
    lines = (done.stderr + done.stdout).strip().splitlines()
    said = next((line for line in lines if line.startswith("ddplab: error: ")), None)
    if said is None:
        raise DdplabError(
            f"the check before the first trial failed ({_exit(done.returncode)}): {lines[-1] if lines else ''}",
            f"run it alone to see why: ddplab {shlex.join(command[3:])}",
        )
    cause, _, fix = said[len("ddplab: error: ") :].partition("; ")
    # the metric to optimize is the trials' checkpoint.monitor, given to the sweep as --monitor
    cause, fix = (part.replace("checkpoint.monitor=", "--monitor ") for part in (cause, fix))
    raise DdplabError(f"before the first trial: {cause}", fix or "fix the settings")


def _command(sweep, values: list[str], name: str, run_dir: str | None = None) -> list[str]:
    """`ddplab run` with the sweep's launch flags and settings, the trial's values, its folder, and
    the sweep's metric as the run's checkpoint.monitor (its best value is what the study is told)."""
    config = ["--config", sweep.config] if sweep.config else []
    return [
        sys.executable,
        "-m",
        "ddplab",
        "run",
        sweep.target,
        *sweep.launch,
        *config,
        *sweep.settings,
        *values,
        f"run.dir={run_dir or sweep.folder}",
        f"run.name={name}",
        f"checkpoint.monitor={sweep.monitor}",
        f"checkpoint.mode={sweep.mode}",
        *([f"log.mlflow_uri={sweep.mlflow_store}"] if sweep.mlflow_store else []),
    ]


def _run(command: list[str], env: dict) -> tuple[int, int | None]:
    """Run a trial's job to its end; the signal that stopped the sweep meanwhile, if any."""
    received = []
    proc = subprocess.Popen(command, env=env, preexec_fn=_die_with_parent)

    def pass_on(signum, frame):
        received.append(signum)
        if signum in _PASSED_ON:
            proc.send_signal(signum)

    before = {sig: signal.signal(sig, pass_on) for sig in (signal.SIGINT, *_PASSED_ON)}
    try:
        return proc.wait(), (received[0] if received else None)
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)


def _die_with_parent() -> None:
    """In the child, before it runs: SIGKILL when the sweep dies, even by SIGKILL (Linux)."""
    if sys.platform.startswith("linux"):
        # PR_SET_PDEATHSIG
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, int(signal.SIGKILL))
