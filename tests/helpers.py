"""Shared helpers for tests that start real processes, and read what a run wrote."""

from __future__ import annotations

import contextlib
import copy
import fcntl
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FIXTURES = Path(__file__).resolve().parent / "fixtures"
# the agent's logger (launch/elastic.py)
_AGENT_LOG = "torch.distributed.elastic.agent.server.api"


def clean_env(**extra: str) -> dict[str, str]:
    """The test process's environment without any launcher variables that would leak into children."""
    drop = (
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "LOCAL_WORLD_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
        "GROUP_RANK",
        "TORCHELASTIC_RUN_ID",
        "PYTEST_CURRENT_TEST",
    )
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in drop and not k.startswith(("SLURM_", "OMPI_", "PMI_", "SM_", "PET_"))
    }
    env.update(extra)
    return env


# every process group a test started; conftest kills what is left
STARTED: list[subprocess.Popen] = []


# monotonic time at which the running test's own timeout fires (conftest)
def cuda_case():
    """The parameter "cuda" of a test that runs on the CPU in the suite and on a GPU in the gpu lane
    (`make test-gpu`); skipped where there is no CUDA."""
    import pytest
    import torch

    no_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: `make test-gpu` on a GPU machine")
    return pytest.param("cuda", marks=[pytest.mark.gpu, no_cuda])


DEADLINE = [float("inf")]


def _load() -> float:
    """This machine's load: the processes that want a core, now (/proc/loadavg's runnable count, less
    this one) or over the last minute, whichever is more (the minute's average lags a load that has
    just begun)."""
    try:
        with open("/proc/loadavg") as f:
            runnable = int(f.read().split()[3].split("/")[0]) - 1
    except (OSError, ValueError, IndexError):
        runnable = 0
    return max(os.getloadavg()[0], runnable)


# How much slower than an idle machine this one is (its load per core when the suite starts, at
# least 1; DDPLAB_TEST_SLOWDOWN sets it). Every test's timeout and every wait it gives a process
# scales by it (conftest.py, budget()), so that on a busy machine a test is judged by its
# assertions, not by the clock.
SLOWDOWN = float(os.environ.get("DDPLAB_TEST_SLOWDOWN") or max(1.0, _load() / (os.cpu_count() or 1)))


def budget(seconds: float) -> float:
    """SECONDS of an idle machine's time, on this one."""
    return seconds * SLOWDOWN


def ddplab(*args: str, timeout: float = 90, env: dict[str, str] | None = None, cwd: str | None = None):
    """Run `python -m ddplab ARGS` and return the CompletedProcess (text output, never hangs the suite)."""
    code, out, err = finish(start(*args, env=env, cwd=cwd), timeout, f"ddplab {' '.join(args)}")
    return subprocess.CompletedProcess(args, code, out, err)


def ddplab_here(*args: str, expect: int | None = None, env: dict[str, str] | None = None, cwd: str | None = None):
    """`ddplab ARGS` in this process: the same CompletedProcess as `ddplab()`, without a new
    interpreter and its ~2 s of CPU importing torch (the suite's dearest part). For what ends by
    itself: a refusal, a one-process run (no -n; DataLoader workers fork from here, as from a user's
    one process), eval, predict, runs, report, and a launch (-n 2), whose launcher runs here while
    torch's agent starts the ranks as processes of their own. Not for a run whose launcher is
    signalled or killed, live replicas, nor a one-process run that compiles (torch.compile's worker
    pool) or kills itself: those belong in their own process (`ddplab()`). A run leaves this process
    as it found it (one_run_here)."""
    from ddplab.launch import cli

    environment = env if env is not None else clean_env()
    with one_run_here(), _output_captured() as output:
        # as the environment of a new process (put back after)
        os.environ.clear()
        os.environ.update(environment)
        # as `python -m ddplab` sets it as it starts, before torch loads
        os.environ.setdefault(*cli.CPP_LOG)
        # found again from that environment's TMPDIR
        tempfile.tempdir = None
        os.chdir(cwd or REPO)
        try:
            code = cli.main(list(args))
        except _Exited as e:
            code = e.code
    res = subprocess.CompletedProcess(args, code, *output)
    if expect is not None:
        assert code == expect, res.stdout + res.stderr
    return res


@contextlib.contextmanager
def _output_captured():
    """What this process prints, down to its descriptors 1 and 2 (which the ranks a launch starts
    inherit), goes to files for the block; the list it yields holds (stdout, stderr) after it."""
    output: list[str] = []
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        for file in (out, err):
            # the launcher and its ranks each write at the end
            fcntl.fcntl(file.fileno(), fcntl.F_SETFL, fcntl.fcntl(file.fileno(), fcntl.F_GETFL) | os.O_APPEND)
        sys.stdout.flush()
        sys.stderr.flush()
        saved = os.dup(1), os.dup(2)
        try:
            os.dup2(out.fileno(), 1)
            os.dup2(err.fileno(), 2)
            with (
                open(1, "w", buffering=1, encoding="utf-8", errors="replace", closefd=False) as printed,
                open(2, "w", buffering=1, encoding="utf-8", errors="replace", closefd=False) as warned,
                contextlib.redirect_stdout(printed),
                contextlib.redirect_stderr(warned),
            ):
                yield output
        finally:
            for fd, old in ((1, saved[0]), (2, saved[1])):
                os.dup2(old, fd)
                os.close(old)
        for file in (out, err):
            file.seek(0)
            output.append(file.read().decode("utf-8", "replace"))


# what ddplab keeps for the life of a process on purpose: names of collectives' call sites, the
# warnings given once, object stores' clients and the timeout each run sets for them, the fork server
# kept for the next launch
_PROCESS_CACHES = {
    "ddplab.distributed.hangs._SITES", "ddplab.checkpoint.store._WARNED", "ddplab.checkpoint.objects._STORES",
    "ddplab.checkpoint.objects.TIMEOUT_S", "ddplab.launch.fork_server._kept",
    "ddplab.launch.fork_server._stopped_at_exit",
}  # fmt: skip


def _ddplab_globals() -> dict[str, dict]:
    """Each ddplab module's globals (a container with a copy of its contents), to check that a run
    in this process changed none of them, as a fixture that patches one for its run might."""
    kept = {}
    for module_name, module in list(sys.modules.items()):
        if module_name == "ddplab" or module_name.startswith("ddplab."):
            kept[module_name] = {
                name: (value, copy.copy(value) if type(value) in (dict, list, set) else None)
                for name, value in vars(module).items()
                if not name.startswith("__")
            }
    return kept


class _Exited(Exception):
    """An in-place run's os._exit, raised instead (ddplab_here)."""

    def __init__(self, code: int):
        self.code = code


# the signals whose handlers a run sets (a stop, a failing rank's DataLoader, a sweep's trials, the
# agent of a launch)
_HANDLED = (
    signal.SIGTERM,
    signal.SIGINT,
    signal.SIGUSR1,
    signal.SIGUSR2,
    signal.SIGHUP,
    signal.SIGQUIT,
    signal.SIGCHLD,
)

# the loggers whose level a launch sets (launcher.launch, elastic.watch_membership)
_LOGGERS = ("torch.distributed.elastic", "torch.distributed.run", "torch.distributed.launcher", _AGENT_LOG)


def _process_settings() -> list[tuple]:
    """What a run sets for its whole process, each as (read it, put it back)."""
    import random

    import numpy as np
    import torch

    from ddplab.checkpoint import objects

    def environ(saved):
        os.environ.clear()
        os.environ.update(saved)

    def deterministic():
        flags = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
        return (*flags, torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark)

    def determinism(saved):
        torch.use_deterministic_algorithms(saved[0], warn_only=saved[1])
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = saved[2:]

    def handlers(saved):
        for sig, handler in saved.items():
            signal.signal(sig, handler)

    def loggers():
        return {name: (logging.getLogger(name).level, logging.getLogger(name).propagate) for name in _LOGGERS}

    def put_loggers(saved):
        for name, (level, propagate) in saved.items():
            logging.getLogger(name).setLevel(level)
            logging.getLogger(name).propagate = propagate

    return [
        (lambda: dict(os.environ), environ),
        (lambda: list(sys.path), lambda saved: sys.path.__setitem__(slice(None), saved)),
        (lambda: list(sys.argv), lambda saved: sys.argv.__setitem__(slice(None), saved)),
        (lambda: list(warnings.filters), lambda saved: warnings.filters.__setitem__(slice(None), saved)),
        (os.getcwd, os.chdir),
        (lambda: tempfile.tempdir, lambda saved: setattr(tempfile, "tempdir", saved)),
        (torch.get_num_threads, torch.set_num_threads),
        (torch.get_default_dtype, torch.set_default_dtype),
        (torch.get_rng_state, torch.set_rng_state),
        (np.random.get_state, np.random.set_state),
        (random.getstate, random.setstate),
        (deterministic, determinism),
        (lambda: {sig: signal.getsignal(sig) for sig in _HANDLED}, handlers),
        (loggers, put_loggers),
        (lambda: list(objects.TIMEOUT_S), lambda saved: objects.TIMEOUT_S.__setitem__(slice(None), saved)),
    ]


@contextlib.contextmanager
def one_run_here():
    """Around a run in this process: it leaves by an exception instead of os._exit, what a run sets
    for the whole process (environment, flags, random streams, threads, path, signal handlers) is
    put back, and what it must release (its process group, its runtime, its run folder's lock: any
    global of ddplab's modules) is checked released, so the next test in this process starts as in
    a new one."""
    import torch.distributed as dist

    from ddplab.checkpoint import objects, store
    from ddplab.launch import replicas, worker

    def leave(code: int):
        raise _Exited(code)

    def refuse(*args, **kwargs):
        raise AssertionError("this command starts replicas: run it in its own process, with ddplab()")

    settings = [(read(), put_back) for read, put_back in _process_settings()]
    grouped = dist.is_initialized()
    before = _ddplab_globals()
    patched = [(worker, "exit_now", leave), (replicas, "launch_replicas", refuse)]
    originals = [(module, name, getattr(module, name)) for module, name, _ in patched]
    for module, name, value in patched:
        setattr(module, name, value)
    try:
        with warnings.catch_warnings():
            # torch's error handler cannot point faulthandler at a captured stderr, and says so
            warnings.filterwarnings("ignore", message="Unable to enable fault handler")
            yield
    finally:
        for module, name, value in originals:
            setattr(module, name, value)
        for saved, put_back in settings:
            put_back(saved)
        # warned once per process, and clients of servers that end with their test
        store._WARNED.clear()
        objects._STORES.clear()
    changed = [
        f"{module}.{name}"
        for module, names in before.items()
        for name, (value, copied) in names.items()
        if f"{module}.{name}" not in _PROCESS_CACHES
        and (vars(sys.modules[module]).get(name) is not value or (copied is not None and copied != value))
    ]
    # (its runtime, stack watcher and held run-folder locks are globals of ddplab's modules)
    left = [f"changed {changed}"] if changed else []
    left += ["a process group"] if dist.is_initialized() and not grouped else []
    assert not left, f"a run in this process left {left} behind"


def start(
    *args: str, env: dict[str, str] | None = None, cwd: str | None = None, module: str = "ddplab", preexec_fn=None
):
    """Start `python -m MODULE ARGS` in its own process group."""
    proc = subprocess.Popen(
        [sys.executable, "-m", module, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env or clean_env(),
        cwd=cwd or str(REPO),
        start_new_session=True,
        preexec_fn=preexec_fn,
    )
    STARTED.append(proc)
    return proc


def start_saver(directory, first_step: int, *extra: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    """ddplab's real checkpoint writer saving step after step into `directory` (fixtures/saver.py),
    in its own process group, once it has committed its first checkpoint."""
    proc = subprocess.Popen(
        [sys.executable, str(FIXTURES / "saver.py"), str(directory), str(first_step), *extra],
        stdout=subprocess.PIPE,
        text=True,
        env=env or clean_env(),
        start_new_session=True,
    )
    STARTED.append(proc)
    # imports are slow under load
    assert proc.stdout.readline().strip(), "the writer committed its first checkpoint"
    return proc


def suite_folder(tmp_path_factory) -> Path:
    """A folder of this run of the suite, shared by its xdist workers: for a result made once per
    run (a reference run). Never the folder above pytest's base folder when run without xdist: that
    is the machine's, kept between runs and shared by every checkout, and a reference another
    version of the code left there would be compared against."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the process and everything it started (workers, the agent): one process group."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)


def finish(proc: subprocess.Popen, timeout: float = 90, what: str = "process") -> tuple[int, str, str]:
    """Wait for `proc`; on a timeout, or when the test itself is stopped (pytest-timeout raises in
    here), the whole process group goes, workers included, so nothing outlives the test. The wait
    never runs past the test's own timeout: it ends a few seconds before, with the output."""
    timeout = max(1.0, min(budget(timeout), DEADLINE[0] - time.monotonic() - 5))
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_group(proc)
        try:
            out, err = proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            # a process outside the group still holds its pipes
            out, err = "", "(no output: its pipes stayed open after the process group was killed)"
        raise AssertionError(f"{what} did not finish in {timeout:.0f} s:\n{out}\n{err}") from None
    finally:
        # workers of a finished launcher, if any survived it
        kill_group(proc)
    return proc.returncode, out, err


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_target(target: str, run_dir, name: str, *args: str, n: int = 2, expect: int = 0):
    """`ddplab run TARGET` on n processes into run_dir/<experiment>/<name>, its launcher in this
    process (ddplab_here; one process, n=1, is a run here without -n); asserts its exit code and
    returns the CompletedProcess. The test's own timeout bounds the run."""
    where = [f"run.dir={run_dir}", f"run.name={name}"]
    res = ddplab_here("run", target, *([] if n == 1 else ["-n", str(n)]), *where, *args)
    assert res.returncode == expect, res.stdout + res.stderr + _run_log(run_dir, name)
    return res


def experiment_of(target: str, run, *overrides: str):
    """The experiment of a finished run, built in this process from the run's config.yaml (and
    OVERRIDES): its checkpoints evaluate or predict here, as one process, without starting one."""
    from ddplab.config import load_config
    from ddplab.entries import load_entry

    cls = load_entry(target)
    return cls(load_config(cls.config_class, list(overrides), str(Path(run) / "config.yaml")))


def _run_log(run_dir, name: str) -> str:
    """The end of the run's own log, where a restarted attempt's lines are (a failure's message
    shows the launcher's output only)."""
    logs = sorted(Path(run_dir).glob(f"*/{name}/log.txt"))
    return "".join(f"\n--- {log}:\n{log.read_text()[-4000:]}" for log in logs)


def metrics_rows(folder) -> list[dict]:
    """A run folder's metrics.jsonl: one dict per line (train/, eval/ and per-rank records), in order."""
    return [json.loads(line) for line in (Path(folder) / "metrics.jsonl").read_text().splitlines()]


def summary_of(folder) -> dict:
    """A finished run's summary.json (its status, steps, last evaluation, per-rank figures)."""
    return json.loads((Path(folder) / "summary.json").read_text())


def netns_unavailable() -> str | None:
    """Why two nodes in network namespaces (scripts/two-nodes.sh) cannot run here, or None."""
    if os.geteuid() != 0:
        return "creating network namespaces needs root"
    if not shutil.which("ip"):
        return "iproute2 (the ip command) is missing: `make test` installs it where apt-get works"
    probe = f"ddplabprobe{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None if made.returncode == 0 else f"this machine does not allow network namespaces ({made.stderr.strip()})"


def s3_client(endpoint: str):
    """boto3's S3 client of the test server at `endpoint` (tests/checkpoint/conftest.py's)."""
    import boto3

    return boto3.client("s3", endpoint_url=endpoint)
