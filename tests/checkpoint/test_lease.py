"""One job at a time writes a run in a bucket (checkpoint/lease.py), against moto's S3 server: a job
that renews its hold refuses the next in one line; one that died lets go after run.storage_lease_s
(at once when it was a process of this machine, or the same job restarted); a holder that stalled
past its lease and was taken over uploads nothing more. Two real jobs given one run name are
tests/checkpoint/test_object_storage.py's."""

import json
import os
import socket
import subprocess
import sys
import time

import pytest
import torch

from ddplab.checkpoint import lease as lease_module
from ddplab.checkpoint.lease import LEASES, RunLease
from ddplab.checkpoint.mirror import RunMirror, Uploads
from ddplab.checkpoint.objects import ObjectStore
from ddplab.errors import DdplabError
from helpers import budget

pytestmark = pytest.mark.timeout(60)
# short, so that a lease left behind expires within the test; renewed every quarter of it
LEASE_S = 1.5


def _store(bucket) -> ObjectStore:
    return ObjectStore(f"{bucket}/runs/exp/r", timeout_s=10)


def _as_another_job(monkeypatch, name: str) -> None:
    monkeypatch.setattr(lease_module, "job_id", lambda: name)


def _hand_written(store: ObjectStore, number: int, host: str, pid: int, job: str = "elsewhere") -> None:
    """The lease a job left behind: written once, never renewed."""
    store.put_bytes(json.dumps({"job": job, "host": host, "pid": pid, "beat": 0}).encode(), LEASES, f"{number:08d}")


def test_a_job_that_renews_its_hold_refuses_the_next_in_one_line(bucket, monkeypatch):
    store = _store(bucket)
    # long enough that a loaded machine still renews within it (a renewal each 2.5 s)
    holder = RunLease(store, 10.0)
    holder.take()
    _as_another_job(monkeypatch, "second")
    said = []
    with pytest.raises(DdplabError) as refused:
        RunLease(store, 10.0).take(say=said.append)
    assert refused.value.cause == (
        f"run {store.url} is being written by another job (process {os.getpid()} on {socket.gethostname()}), whose "
        "hold on it in the bucket was renewed within run.storage_lease_s=10 s"
    )
    # it watched for a renewal, once
    assert "give this run another run.name" in refused.value.fix and len(said) == 1
    # once the first lets go, the run is the next job's without watching
    holder.release()
    nxt = RunLease(store, 10.0)
    nxt.take(say=said.append)
    assert len(said) == 1
    nxt.release()
    assert store.find(LEASES) == []


def test_a_job_on_another_machine_that_died_lets_go_of_the_run_after_its_lease(bucket):
    store = _store(bucket)
    _hand_written(store, 4, "a-machine-that-is-gone", 4242)
    said = []
    taker = RunLease(store, LEASE_S)
    taker.take(say=said.append)
    assert "held by another job (process 4242 on a-machine-that-is-gone): watching for up to 1.5 s" in said[0]
    # the next number, and the dead job's record gone
    assert store.find(LEASES) == [f"{LEASES}/00000005"]
    taker.release()


@pytest.mark.parametrize("how", ["a process of this machine that is gone", "the same job restarted"])
def test_a_dead_process_here_or_the_same_job_takes_the_run_over_at_once(bucket, monkeypatch, how):
    store = _store(bucket)
    if how == "the same job restarted":
        # torch's agent gives every attempt of one launch the same run id
        monkeypatch.setenv("TORCHELASTIC_RUN_ID", "launch-1")
        _hand_written(store, 1, "another-host", 1, job="launch-1")
    else:
        gone = subprocess.Popen([sys.executable, "-c", "pass"])
        gone.wait()
        _hand_written(store, 1, socket.gethostname(), gone.pid)
    said = []
    # a lease longer than the test's timeout: taken without watching it, or the test fails
    taker = RunLease(store, 300.0)
    taker.take(say=said.append)
    assert not said
    taker.release()


def test_a_holder_that_stalled_past_its_lease_and_was_taken_over_uploads_nothing_more(bucket, tmp_path, monkeypatch):
    store = _store(bucket)
    stalled = RunLease(store, LEASE_S, warn=(warned := []).append)
    stalled.take()
    # what a stall looks like from the bucket: another job's newer lease
    newer = stalled.number + 1
    _hand_written(store, newer, "the-new-machine", 77)
    deadline = time.monotonic() + budget(10)
    while stalled.lost is None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert stalled.lost["host"] == "the-new-machine"
    assert "was taken over by another job (process 77 on the-new-machine)" in warned[0]
    # a checkpoint committed locally after that stays local, and the run's end says why
    folder = tmp_path / "checkpoints" / "step-00000003"
    folder.mkdir(parents=True)
    torch.save({"x": 1}, folder / "state.pt")
    uploads = Uploads(RunMirror(store.url, str(tmp_path)), 2, 0, "max", stalled)
    uploads.after_commit(str(folder))
    assert not store.find("checkpoints")
    with pytest.raises(DdplabError) as ended:
        uploads.confirm()
    assert "process 77 on the-new-machine took the run over after this job did not renew its hold" in str(ended.value)
    # its release leaves the new holder's lease alone
    stalled.release()
    assert json.loads(store.read_bytes(LEASES, f"{newer:08d}"))["host"] == "the-new-machine"
