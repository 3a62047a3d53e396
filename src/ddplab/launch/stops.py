"""A job stopped by a signal: exit 128 + N, say what was saved, and print the command that continues it.

Workers of ddplab's launcher exit 0 after such a stop (else torch's agent would restart them) and
rank 0 leaves a note in `plan.stop_file` for the launcher; workers started otherwise exit 128 + N."""

import contextlib
import json
import os
import shlex
import signal
import sys
from pathlib import Path

from .. import environment
from ..train.rundir import read_json
from . import fork_server
from .notebook import session_call
from .plan import RunPlan


def prepare(plan: RunPlan, folder: str) -> None:
    """Give the plan a place in FOLDER (the launch's own, removed when it ends) for rank 0's stop note,
    and pass the preemption signals the agent does not handle (SLURM's SIGUSR1) from this process to
    its workers, which save and stop on them."""
    plan.stop_file = os.path.join(folder, "stop.json")
    _, cfg = plan.load()
    names = cfg.checkpoint.preempt_signals.split(",") if cfg is not None and "checkpoint" in cfg else []
    for name in {n.strip() for n in names} - {"SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT", ""}:
        # the agent's own
        signal.signal(signal.Signals[name], _to_children)


def leave_note(plan: RunPlan, signal_name: str | None, step: int, run_dir: str, not_uploaded: str | None = None) -> int:
    """Rank 0 of a stopped run, or of one that finished (signal None), leaves a note for the launcher
    (every rank calls it; NOT_UPLOADED: why the stop's checkpoint is not in the run's bucket); returns
    the worker's exit code."""
    if plan.stop_file and os.environ.get(environment.RANK, "0") == "0":
        note = {"signal": signal_name, "step": step, "run_dir": run_dir, "not_uploaded": not_uploaded}
        Path(plan.stop_file).write_text(json.dumps(note))
    if signal_name is None:
        return 0
    return 0 if plan.launcher_pid else 128 + signal.Signals[signal_name].value


def forget_note(plan: RunPlan) -> None:
    """Workers that start remove a stop note the workers before them left on this node: those were
    stopped to regroup the job for a joining node (launch/elastic.py), and the job went on."""
    if plan.stop_file and os.environ.get(environment.LOCAL_RANK, "0") == "0" and os.path.exists(plan.stop_file):
        os.remove(plan.stop_file)


def expect_failures(plan: RunPlan) -> None:
    """Name this attempt's failure note (set in the environment of the worker): when a worker of a
    job fails, torch's agent sends the others SIGTERM and waits up to 30 s before SIGKILL. A worker
    busy outside a collective would take that SIGTERM for a preemption and go on to its next step
    before it finds the peer gone; with the note there it ends at once (train/signals.py). One note
    per attempt: workers the agent restarts after a failure are told of their own attempt's only."""
    if plan.stop_file:
        note = os.path.join(os.path.dirname(plan.stop_file), f"failed-{environment.restart_count()}")
        os.environ[environment.PEER_FAILED] = note


def note_failure() -> None:
    """A worker that is about to exit failed: the others on this node end at the agent's SIGTERM."""
    if note := os.environ.get(environment.PEER_FAILED):
        Path(note).touch()


def stand_down() -> None:
    """This worker is leaving: a peer's failure no longer ends it where it is (its teardown, its own
    report after a failure go on to their end)."""
    os.environ.pop(environment.PEER_FAILED, None)


def report(plan: RunPlan, signal_name: str | None = None) -> int | None:
    """After the workers ended: the exit code of a job a signal stopped (saying what was saved), else None."""
    note = read_json(plan.stop_file)
    name = note.get("signal") or signal_name
    if name is None:
        return None
    if note and note.get("signal") is None:
        # the signal came as the run was ending (in on_fit_end, its export): nothing to continue
        print(
            f"ddplab: {name} came after training had finished; the run is complete in {note['run_dir']}",
            file=sys.stderr,
            flush=True,
        )
        return 0
    saved = (
        f"a checkpoint was saved at step {note['step']} in {note['run_dir']}"
        if note
        else "nothing was saved at the stop (checkpoints written before it remain)"
    )
    continues = "To continue"
    if note.get("not_uploaded"):
        # on this machine's disk only: the same command here uploads it first (mirror.catch_up)
        saved += f", and not in the run's bucket ({note['not_uploaded']})"
        continues = "To continue, on this machine once the store answers"
    print(f"ddplab: stopped by {name}; {saved}. {continues}: {resume_command(plan)}", file=sys.stderr, flush=True)
    return 128 + signal.Signals[name].value


def resume_command(plan: RunPlan) -> str:
    """The command line of this job, naming its run so that it resumes that run, not a new one."""
    args = sys.argv[1:]
    _, cfg = plan.load()
    if cfg is not None and "run" in cfg and not any(a.startswith("run.name=") for a in args):
        args = [*args, f"run.name={cfg.run.name}"]
    if os.environ.get(environment.RETURNED):
        # started by ddplab.run in a Python session: the call to make there again
        return session_call(args)
    return shlex.join(["ddplab", *args])


def _to_children(signum, frame) -> None:
    """Send the signal to this process's workers: its direct children (torch's agent starts them so),
    or the fork server's children where they fork from it, never Python's helper processes."""
    server, helpers = fork_server.helpers()
    for pid in map(int, filter(str.isdigit, os.listdir("/proc") if os.path.isdir("/proc") else [])):
        parent = fork_server.parent_of(pid)
        if (parent == os.getpid() and pid not in helpers) or (server and parent == server):
            # (gone meanwhile)
            with contextlib.suppress(OSError):
                os.kill(pid, signum)
