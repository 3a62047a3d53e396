"""Shared helpers for tests that start real processes."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FIXTURES = Path(__file__).resolve().parent / "fixtures"


def clean_env(**extra: str) -> dict[str, str]:
    """The test process's environment without any launcher variables that would leak into children."""
    drop = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK",
            "TORCHELASTIC_RUN_ID", "PYTEST_CURRENT_TEST")
    env = {k: v for k, v in os.environ.items() if k not in drop and not k.startswith(("SLURM_", "OMPI_", "PMI_", "SM_"))}
    env.update(extra)
    return env


def ddplab(*args: str, timeout: float = 90, env: dict[str, str] | None = None, cwd: str | None = None):
    """Run `python -m ddplab ARGS` and return the CompletedProcess (text output, never hangs the suite).

    On a timeout the whole process group goes, workers included, so nothing outlives the test."""
    proc = start(*args, env=env, cwd=cwd)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        out, err = proc.communicate()
        raise AssertionError(f"ddplab {' '.join(args)} did not finish in {timeout} s:\n{out}\n{err}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def start(*args: str, env: dict[str, str] | None = None, cwd: str | None = None, module: str = "ddplab"):
    """Start `python -m ddplab ARGS` in its own process group."""
    return subprocess.Popen(
        [sys.executable, "-m", module, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=env or clean_env(), cwd=cwd or str(REPO), start_new_session=True,
    )


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def finish(proc: subprocess.Popen, timeout: float = 90) -> tuple[int, str, str]:
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        out, err = proc.communicate()
        raise AssertionError(f"process did not finish in {timeout} s:\n{out}\n{err}")
    return proc.returncode, out, err


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
