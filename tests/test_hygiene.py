"""The test helpers themselves: a wait that runs out, or a test stopped by its timeout, leaves no
process of the job behind (launcher, elastic agent and workers are one process group)."""

import os
import time
from pathlib import Path

import pytest

from helpers import finish, start

EXP = "tests/fixtures/experiments.py:Classifier"


def _processes() -> dict[int, int]:
    """pid -> parent pid of every running process (zombies waiting to be reaped left out)."""
    table = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            # state, ppid, ...
            fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z":
            table[int(entry)] = int(fields[1])
    return table


def _descendants(pid: int) -> set[int]:
    table, found = _processes(), {pid}
    while True:
        more = {p for p, parent in table.items() if parent in found} - found
        if not more:
            return found & set(table)
        found |= more


@pytest.mark.slow
@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads the process table from /proc")
@pytest.mark.timeout(60)
def test_a_wait_that_runs_out_kills_the_launcher_and_every_worker(tmp_path):
    """torch's agent starts each worker in a session of its own, so killing the launcher's process
    group reaches them only because they end with their launcher (PR_SET_PDEATHSIG)."""
    proc = start(
        "run",
        EXP,
        "-n",
        "2",
        f"run.dir={tmp_path}",
        "trainer.max_steps=100000",
        "fault.step_sleep=0.5",
        "trainer.progress=false",
        "log.tensorboard=false",
    )
    deadline = time.monotonic() + 30
    while len(_descendants(proc.pid)) < 3 and time.monotonic() < deadline:
        # the launcher and 2 workers
        time.sleep(0.2)
    job = _descendants(proc.pid)
    assert len(job) >= 3
    # (2 s of an idle machine's time: more on a busy one)
    with pytest.raises(AssertionError, match=r"did not finish in \d+ s"):
        finish(proc, timeout=2)
    deadline = time.monotonic() + 5
    while job & set(_processes()) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not job & set(_processes())
