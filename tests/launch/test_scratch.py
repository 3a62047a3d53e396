"""A launch's folder in the temporary folder (launch/scratch.py): a launcher killed with SIGKILL leaves
it behind, and the next start removes it, never a folder whose maker is alive."""

import fcntl
import os
import time

import pytest

from ddplab.launch import scratch
from helpers import clean_env, ddplab, kill_group, start


def test_only_folders_nobody_holds_are_removed(tmp_path, monkeypatch):
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    with scratch.scratch_folder("ddplab-launch-") as live:
        # another launch's, alive: its lock is held (a second open file is a second holder)
        assert scratch.remove_abandoned() == []
        # a dead launch's: its lock file is there and nobody holds it
        dead = tmp_path / "ddplab-stop-dead"
        dead.mkdir()
        (dead / scratch.HELD).touch()
        # being made (no lock file yet), and another program's
        (tmp_path / "ddplab-replicas-new").mkdir()
        (tmp_path / "other-held").mkdir()
        (tmp_path / "other-held" / scratch.HELD).touch()
        assert scratch.remove_abandoned() == [str(dead)]
        assert os.path.isdir(live) and not dead.exists()
        assert sorted(os.listdir(tmp_path)) == sorted([os.path.basename(live), "ddplab-replicas-new", "other-held"])
        # the live one is held by an open file the workers do not inherit
        held = os.open(os.path.join(live, scratch.HELD), os.O_RDONLY)
        with pytest.raises(BlockingIOError):
            fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.close(held)
    assert not os.path.exists(live)


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_a_launcher_killed_with_sigkill_leaves_its_folder_to_the_next_start(tmp_path):
    env = clean_env(TMPDIR=str(tmp_path))
    proc = start("run", "tests/fixtures/probe.py:report", "-n", "2", f"run.dir={tmp_path}", env=env)
    deadline = time.monotonic() + 30
    while not list(tmp_path.glob(f"ddplab-launch-*/{scratch.HELD}")) and time.monotonic() < deadline:
        time.sleep(0.05)
    kill_group(proc)
    proc.wait(timeout=30)
    left = list(tmp_path.glob("ddplab-launch-*"))
    assert len(left) == 1, f"one launch folder, held, was to be left by the killed launcher: {left}"
    left = left[0]
    # the next start of any kind, here a one-process run, removes it and leaves nothing of its own
    res = ddplab("run", "tests/fixtures/probe.py:report", f"run.dir={tmp_path}", env=env)
    assert res.returncode == 0, res.stdout + res.stderr
    assert not left.exists()
    assert not list(tmp_path.glob("ddplab-*"))
