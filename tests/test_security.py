"""Single-node jobs listen on loopback only (checkpoints never unpickle code: see test_checkpoints)."""

import glob
import os
import time
from pathlib import Path

import pytest

from helpers import finish, start

# /proc/net/tcp: little-endian hex address, TCP state code
LOOPBACK_V4, LISTEN = "0100007F", "0A"


def _descendants(root: int) -> set[int]:
    """`root` and every process under it (the launcher, torch's agent, the workers)."""
    parents = {}
    for stat in glob.glob("/proc/[0-9]*/stat"):
        try:
            fields = Path(stat).read_text().rsplit(")", 1)[1].split()
            parents[int(stat.split("/")[2])] = int(fields[1])
        except (OSError, IndexError, ValueError):
            # a process that just exited
            continue
    tree, grew = {root}, True
    while grew:
        more = {pid for pid, parent in parents.items() if parent in tree} - tree
        tree |= more
        grew = bool(more)
    return tree


def _socket_inodes(pids: set[int]) -> set[str]:
    inodes = set()
    for pid in pids:
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith("socket:["):
                    inodes.add(target[8:-1])
        except OSError:
            continue
    return inodes


def _listening(inodes: set[str]) -> list[str]:
    """Local addresses (hex, as the kernel prints them) of the listening TCP sockets among `inodes`."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            cols = line.split()
            if cols[3] == LISTEN and cols[9] in inodes:
                found.append(cols[1].split(":")[0])
    return found


def _is_loopback(hex_addr: str) -> bool:
    return (
        hex_addr == LOOPBACK_V4
        or (hex_addr.endswith("0100007F") and hex_addr.startswith("0000000000000000FFFF"))
        or hex_addr == "00000000000000000000000001000000"
    )


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_single_node_job_listens_on_loopback_only(tmp_path):
    proc = start(
        "run",
        "tests/fixtures/experiments.py:Classifier",
        "-n",
        "2",
        f"run.dir={tmp_path}",
        "run.name=s",
        "trainer.max_steps=40",
        "fault.step_sleep=0.1",
        "trainer.log_every=1",
        "trainer.progress=false",
        "log.tensorboard=false",
    )
    metrics = tmp_path / "classifier" / "s" / "metrics.jsonl"
    deadline = time.monotonic() + 60
    while not (metrics.exists() and metrics.read_text().count("\n") >= 3) and time.monotonic() < deadline:
        time.sleep(0.2)
    # the launcher, its agent and both workers
    addresses = _listening(_socket_inodes(_descendants(proc.pid)))
    code, out, err = finish(proc, timeout=90)
    assert code == 0, out + err
    assert len(addresses) >= 3, "expected the rendezvous store and the workers' gloo sockets"
    assert all(_is_loopback(a) for a in addresses), f"listening beyond loopback: {addresses}"
