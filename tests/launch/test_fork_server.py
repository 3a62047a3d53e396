"""Workers forked from a server that imported torch and ddplab once (launch/fork_server.py): how they
start, what they get from the launcher, and that they stop and die with the job as workers started
as their own processes do."""

import json
import os
import pickle
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from ddplab.launch import fork_server
from helpers import clean_env, ddplab_here, finish, start

REPO = Path(__file__).resolve().parents[2]
PROBE = "tests/fixtures/probe.py"
EXP = "tests/fixtures/experiments.py:Classifier"
QUIET = ["trainer.progress=false", "log.tensorboard=false", "trainer.global_batch_size=32"]
pytestmark = pytest.mark.timeout(60)


def _where(res) -> list[dict]:
    rows = [json.loads(line.split("WHERE ", 1)[1]) for line in res.stdout.splitlines() if "WHERE " in line]
    return sorted(rows, key=lambda r: r["rank"])


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie is gone but for its exit status
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] != "Z"


@pytest.mark.slow
def test_the_workers_fork_from_one_server_kept_for_the_launchers_next_launch_in_the_same_environment(
    tmp_path, monkeypatch
):
    env = clean_env(PROBE_MARK="from the launcher")
    res = ddplab_here("run", f"{PROBE}:where", "-n", "2", env=env, expect=0)
    rows = _where(res)
    assert [r["rank"] for r in rows] == [0, 1], res.stdout + res.stderr
    # one server, started by this process (the launcher, here), is both workers' parent
    (server,) = {r["parent"] for r in rows}
    assert all(r["grandparent"] == os.getpid() for r in rows)
    assert "multiprocessing.forkserver" in rows[0]["parent_command"]
    # they start as a worker started by itself would: the launcher's environment, Python's default
    # start method for their own processes (a DataLoader's), no signal held back
    assert all(r["mark"] == "from the launcher" for r in rows)
    assert all(r["start_method"] == "fork" for r in rows)
    assert all(r["blocked"] == [] for r in rows)
    # the next launch of this process forks from the same server, in its own working folder, with its
    # sys.path, and its workers print to where this launch's output goes (its rows are read from it)
    monkeypatch.syspath_prepend(str(tmp_path))
    again = _where(ddplab_here("run", f"{REPO / PROBE}:where", "-n", "2", env=env, cwd=str(tmp_path), expect=0))
    assert [r["parent"] for r in again] == [server, server]
    assert [r["cwd"] for r in again] == [str(tmp_path)] * 2
    assert all(str(tmp_path) in r["path"] for r in again)
    # another environment (torch reads some variables as it is imported): a new server, the old one stopped
    changed = _where(ddplab_here("run", f"{PROBE}:where", "-n", "2", env=clean_env(PROBE_MARK="changed"), expect=0))
    assert [r["mark"] for r in changed] == ["changed"] * 2
    assert changed[0]["parent"] != server and not _alive(server)


@pytest.mark.slow
def test_a_process_that_launches_twice_keeps_one_server_which_ends_with_it_not_with_a_child():
    # between the launches, a child forked from the process launches too, and exits as a program
    # does (its atexit hooks run); a short folder for the socket (a test's own tmp_path under xdist
    # is too long for one, and the workers would start as their own processes)
    short = Path(tempfile.mkdtemp(prefix="fs-"))
    launches = (
        "import os, sys; from ddplab.launch.cli import main; main(['run', '{0}:where', '-n', '2']); "
        "pid = os.fork(); pid == 0 and sys.exit(main(['run', '{0}:where', '-n', '2'])); os.waitpid(pid, 0); "
        "main(['run', '{0}:where', '-n', '2'])"
    )
    done = subprocess.run([sys.executable, "-c", launches.format(REPO / PROBE)], env=clean_env(TMPDIR=str(short)),
                          cwd=REPO, capture_output=True, text=True, timeout=50)  # fmt: skip
    assert done.returncode == 0, done.stderr
    rows = [json.loads(line.split("WHERE ", 1)[1]) for line in done.stdout.splitlines() if "WHERE " in line]
    assert len(rows) == 6, done.stdout
    # the child's workers are its own processes; the parent's two launches fork from one server
    childs = [r for r in rows if "-m ddplab.launch.worker" in r["command"]]
    assert len(childs) == 2 and len({r["parent"] for r in childs}) == 1, done.stdout
    forked = [r for r in rows if r not in childs]
    assert all("multiprocessing.forkserver" in r["parent_command"] for r in forked), done.stdout
    assert len({r["parent"] for r in forked}) == 1, done.stdout
    # gone with the process: the server, and the folder its socket was in
    assert not _alive(forked[0]["parent"])
    assert not list(short.glob(f"{fork_server.SCRATCH_PREFIX}*"))
    shutil.rmtree(short)


@pytest.mark.slow
def test_where_the_server_is_turned_off_or_cannot_have_its_socket_each_worker_is_its_own_process(tmp_path):
    long_folder = tmp_path / ("t" * 100)
    long_folder.mkdir()
    for env in (clean_env(DDPLAB_FORK_SERVER="0"), clean_env(TMPDIR=str(long_folder))):
        rows = _where(ddplab_here("run", f"{PROBE}:where", "-n", "2", env=env, expect=0))
        assert [r["parent"] for r in rows] == [os.getpid(), os.getpid()]
        assert all("-m ddplab.launch.worker" in r["command"] for r in rows)


def test_a_worker_starts_from_the_launchers_environment_as_it_is_when_the_worker_starts(monkeypatch):
    monkeypatch.setenv("PROBE_MARK", "at the start")
    taken = pickle.dumps(fork_server.LaunchersEnvironment())
    monkeypatch.setenv("PROBE_MARK", "later")
    monkeypatch.setenv("PROBE_ONLY_LATER", "1")
    pickle.loads(taken)
    assert os.environ["PROBE_MARK"] == "at the start"
    assert "PROBE_ONLY_LATER" not in os.environ


def _in_the_background():
    # what a shell's `cmd &` does to the command (without job control)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGQUIT, signal.SIG_IGN)


def _steps_then(signum: int, tmp_path, killed_alone: bool, preexec_fn=None):
    """A run of two forked workers, sent SIGNUM once it trained a few steps: to its launcher alone,
    or to the whole process group (a notebook's interrupt, Slurm's scancel)."""
    proc = start("run", EXP, "-n", "2", f"run.dir={tmp_path}", *QUIET, "trainer.max_steps=400",
                 "fault.step_sleep=0.1", preexec_fn=preexec_fn)  # fmt: skip
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not list(tmp_path.glob("*/*/metrics.jsonl")):
        time.sleep(0.2)
    time.sleep(1)
    (server,) = [p for p in _children(proc.pid) if "multiprocessing.forkserver" in _command_line(p)]
    workers = _children(server)
    if killed_alone:
        os.kill(proc.pid, signum)
    else:
        os.killpg(proc.pid, signum)
    return proc, workers


def _children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(p) for p in f.read().split()]


def _command_line(pid: int) -> str:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return f.read().replace(b"\0", b" ").decode()


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_stop_signal_sent_to_the_whole_job_saves_a_checkpoint_where_it_stopped(tmp_path):
    proc, _ = _steps_then(signal.SIGTERM, tmp_path, killed_alone=False)
    code, _, err = finish(proc, timeout=60)
    assert code == 128 + signal.SIGTERM, err
    assert "ddplab: stopped by SIGTERM; a checkpoint was saved at step" in err, err


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_job_started_in_the_background_still_stops_at_sigint_to_its_launcher(tmp_path):
    proc, _ = _steps_then(signal.SIGINT, tmp_path, killed_alone=True, preexec_fn=_in_the_background)
    code, _, err = finish(proc, timeout=60)
    assert code == 128 + signal.SIGINT, err
    # the workers took it (a worker that ignored it would be killed 30 s later, saying nothing)
    assert "ddplab: interrupted" in err and "ddplab: stopped by SIGINT" in err, err


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_launcher_killed_by_sigkill_takes_the_server_and_its_workers_with_it(tmp_path):
    proc, workers = _steps_then(signal.SIGKILL, tmp_path, killed_alone=True)
    assert len(workers) == 2
    proc.wait(timeout=10)
    deadline = time.monotonic() + 10
    while any(_alive(p) for p in workers) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(p) for p in workers)
    _, _, err = finish(proc, timeout=10)
    assert "leaked" not in err, err
