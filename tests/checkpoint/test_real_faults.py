"""Faults made real: ddplab's own checkpoint writer SIGKILLed at random moments, and a disk that
is really full (a small tmpfs). Whatever happens, every checkpoint that is listed loads, and it
holds exactly the state of its step."""

import os
import random
import signal
import subprocess
import time

import pytest
import torch

from ddplab.checkpoint.store import list_checkpoints, load_state
from helpers import ddplab_here, finish, start, start_saver


def _assert_every_listed_checkpoint_is_whole(directory):
    infos = list_checkpoints(str(directory))
    for info in infos:
        # weights_only; raises if truncated
        state = load_state(info.path)
        assert state["progress"]["step"] == info.step
        assert all(torch.equal(t, torch.full_like(t, float(info.step))) for t in state["models"]["net"].values())
    return infos


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_the_real_writer_killed_at_random_moments_never_loses_the_newest_checkpoint(tmp_path):
    rng, newest = random.Random(0), 0
    for _ in range(8):
        proc = start_saver(tmp_path, newest)
        # then somewhere inside a save, or between two
        time.sleep(rng.uniform(0.0, 1.5))
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
        infos = _assert_every_listed_checkpoint_is_whole(tmp_path)
        assert infos, "a checkpoint was committed before the kill"
        # never older than what was there before this round
        assert infos[-1].step >= newest
        newest = infos[-1].step
    # every round saved at least once before its kill
    assert newest >= 8


@pytest.fixture
def small_disk(tmp_path):
    """A 1 MiB tmpfs: writing past it fails with ENOSPC, as a full disk does."""
    mount = tmp_path / "disk"
    mount.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root; docs/testing.md says what CI covers without it")
    made = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)], capture_output=True, text=True
    )
    if made.returncode:
        pytest.skip(f"this machine does not allow mounting a tmpfs ({made.stderr.strip()})")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], capture_output=True)


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_a_really_full_disk_stops_the_run_in_one_line_and_keeps_what_was_saved(small_disk):
    """About 150 KB a checkpoint and all of them kept: the disk fills up after a few saves."""
    res = ddplab_here(
        "run",
        "tests/fixtures/experiments.py:Classifier",
        "-n",
        "2",
        f"run.dir={small_disk}",
        "run.name=r",
        "trainer.progress=false",
        "log.tensorboard=false",
        "trainer.global_batch_size=32",
        "model.hidden=2048",
        "trainer.max_steps=60",
        "trainer.checkpoint_every=2",
        "checkpoint.keep_last=0",
    )
    assert res.returncode == 2, res.stdout + res.stderr
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, res.stderr
    assert "could not write checkpoint" in lines[0] and "(No space left on device)" in lines[0]
    checkpoints = small_disk / "classifier" / "r" / "checkpoints"
    infos = list_checkpoints(str(checkpoints))
    assert len(infos) >= 2 and [i.step for i in infos] == list(range(2, 2 * len(infos) + 1, 2))
    for info in infos:
        assert load_state(info.path)["progress"]["step"] == info.step
    # the failed save left nothing
    assert not [p for p in os.listdir(checkpoints) if p.startswith(".tmp-")]


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_read_only_run_folder_is_one_line_for_every_command_and_changes_nothing(small_disk):
    common = ["trainer.progress=false", "log.tensorboard=false", "trainer.global_batch_size=32"]
    exp, run_dir = "tests/fixtures/experiments.py:Classifier", small_disk / "classifier" / "r"
    ddplab_here("run", exp, f"run.dir={small_disk}", "run.name=r", *common, "trainer.max_steps=2", expect=0)
    before = sorted(str(p.relative_to(small_disk)) for p in small_disk.rglob("*"))
    remounted = subprocess.run(["mount", "-o", "remount,ro", str(small_disk)], capture_output=True, text=True)
    # root may write to a read-only folder, never to this
    assert remounted.returncode == 0, remounted.stderr
    for args, message in [
        (
            ["run", exp, f"run.dir={small_disk}", "run.name=r", *common, "trainer.max_steps=4"],
            f"cannot write the run directory {run_dir} (Read-only file system); pass a writable run.dir=PATH",
        ),
        (
            ["eval", exp, "--checkpoint", str(run_dir), *common],
            f"cannot write the evaluation metrics to {run_dir}/results/eval-step-00000002.json (Read-only file system)",
        ),
        (["report", str(run_dir)], "(Read-only file system); pass --out PATH elsewhere"),
    ]:
        res = ddplab_here(*args)
        lines = [line for line in res.stderr.splitlines() if line.strip()]
        assert res.returncode == 2 and len(lines) == 1 and message in lines[0], (args, res.stderr)
    assert sorted(str(p.relative_to(small_disk)) for p in small_disk.rglob("*")) == before


def _limit_file_size():
    """In the launcher and so in its workers: no file may grow past 100 KB, and the write that
    would gets EFBIG instead of the SIGXFSZ that would kill the process. Needs no root."""
    import resource

    resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, 100_000))
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)


@pytest.mark.slow
@pytest.mark.timeout(90)
@pytest.mark.parametrize("save", ["sync", "async"])
def test_a_file_size_limit_stops_the_run_in_one_line(tmp_path, save):
    """An async save fails in its background thread: the error must still reach the user, once."""
    proc = start(
        "run",
        "tests/fixtures/experiments.py:Classifier",
        "-n",
        "2",
        f"run.dir={tmp_path}",
        "run.name=r",
        "trainer.progress=false",
        "log.tensorboard=false",
        "trainer.global_batch_size=32",
        "model.hidden=2048",
        "trainer.max_steps=10",
        "trainer.checkpoint_every=2",
        f"checkpoint.async={save == 'async'}",
        preexec_fn=_limit_file_size,
    )
    code, _, err = finish(proc, 80)
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1, err
    assert "could not write checkpoint" in lines[0] and "(File too large)" in lines[0]
    assert list_checkpoints(str(tmp_path / "classifier" / "r" / "checkpoints")) == []
