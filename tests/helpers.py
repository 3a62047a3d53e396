"""Shared helpers for tests that start real processes, and read what a run wrote."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FIXTURES = Path(__file__).resolve().parent / "fixtures"


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


def ddplab(*args: str, timeout: float = 90, env: dict[str, str] | None = None, cwd: str | None = None):
    """Run `python -m ddplab ARGS` and return the CompletedProcess (text output, never hangs the suite)."""
    code, out, err = finish(start(*args, env=env, cwd=cwd), timeout, f"ddplab {' '.join(args)}")
    return subprocess.CompletedProcess(args, code, out, err)


def ddplab_here(capsys, *args: str):
    """`ddplab ARGS` in this process, for a command the launcher refuses before any worker starts: the
    same CompletedProcess as `ddplab()`, without a new process and its import of torch."""
    from ddplab.launch.cli import main

    code = main(list(args))
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(args, code, out, err)


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


def kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the process and everything it started (workers, the agent): one process group."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)


def finish(proc: subprocess.Popen, timeout: float = 90, what: str = "process") -> tuple[int, str, str]:
    """Wait for `proc`; on a timeout, or when the test itself is stopped (pytest-timeout raises in
    here), the whole process group goes, workers included, so nothing outlives the test. The wait
    never runs past the test's own timeout: it ends a few seconds before, with the output."""
    timeout = max(1.0, min(timeout, DEADLINE[0] - time.monotonic() - 5))
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


def run_target(target: str, run_dir, name: str, *args: str, n: int = 2, expect: int = 0, timeout: float = 200):
    """`ddplab run TARGET` on n processes (-n left out for one) into run_dir/<experiment>/<name>;
    asserts its exit code and returns the CompletedProcess."""
    ranks = ["-n", str(n)] if n > 1 else []
    res = ddplab("run", target, *ranks, f"run.dir={run_dir}", f"run.name={name}", *args, timeout=timeout)
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
