"""Live recovery (dist.fault_tolerance=live) with real processes over gloo, a real lighthouse and real
SIGKILLs: the survivors never restart, the replacement heals from a peer, every replica ends on the
same weights bit for bit, and those are an uninterrupted run's up to float rounding."""

import json
import os
import re
import signal
import time
from pathlib import Path

import pytest
import torch
from filelock import FileLock
from safetensors.torch import load_file

from ddplab.tools.listing import run_status
from helpers import budget, clean_env, ddplab, ddplab_here, finish, free_port, run_target, start, suite_folder

pytest.importorskip("torchft")
pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

TARGET = "tests/fixtures/live.py:Replicated"
STEPS = 40
COMMON = [
    f"trainer.max_steps={STEPS}",
    "trainer.global_batch_size=32",
    "trainer.progress=false",
    "trainer.log_every=5",
    "log.tensorboard=false",
]
# how long a replica waits for its peers: longer on a busy machine
LIVE = ["dist.fault_tolerance=live", f"dist.timeout_s={budget(20):.0f}"]
# The replicas share each step's global batch, so they compute the uninterrupted run's gradient in
# another order of additions (a sum over 2 or 3 shares, not one): the weights stay within float
# rounding of it. Measured after 40 AdamW steps: 1.2e-7; a share counted wrong is 1e-2 away.
TOLERANCE = 1e-5


def _final(folder: Path) -> dict[str, torch.Tensor]:
    return load_file(next((folder / "final").glob("*.safetensors")))


def _records(folder: Path) -> list[dict]:
    return [json.loads(line) for line in (folder / "live.jsonl").read_text().splitlines()]


@pytest.fixture(scope="session")
def uninterrupted(tmp_path_factory) -> dict[str, torch.Tensor]:
    """The weights of the same training in one process, without live recovery: made once per suite."""
    root = suite_folder(tmp_path_factory) / "live-uninterrupted"
    with FileLock(str(root) + ".lock"):
        folder = root / "replicated" / "plain"
        if not (folder / "final").exists():
            run_target(TARGET, root, "plain", *COMMON, n=1)
        return _final(folder)


def _live_run(tmp_path, replicas: int, kill: str, *extra: str, env: dict | None = None):
    """`ddplab run -n REPLICAS` with live recovery, one replica SIGKILLed as `kill` says (fixtures/live.py)."""
    killing = {"DDPLAB_TEST_KILL": kill, "DDPLAB_TEST_KILL_ONCE": str(tmp_path / "killed")}
    env = clean_env(**{**killing, "DDPLAB_TEST_STEP_S": "0.15", **(env or {})})
    args = ["run", TARGET, "-n", str(replicas), f"run.dir={tmp_path}", "run.name=live", *COMMON, *LIVE, *extra]
    code, out, err = finish(start(*args, env=env), 150, "ddplab run (live)")
    assert code == 0, out + err
    assert (tmp_path / "killed").exists(), "the replica was never killed"
    return out + err, [tmp_path / "replicated" / "live" / f"replica-{r}" for r in range(replicas)]


def _check_same_weights(folders: list[Path], uninterrupted: dict) -> None:
    first = _final(folders[0])
    for folder in folders[1:]:
        other = _final(folder)
        assert all(torch.equal(first[k], other[k]) for k in first), f"{folder.name} differs from {folders[0].name}"
    gap = max((first[k] - uninterrupted[k]).abs().max().item() for k in first)
    assert gap < TOLERANCE, gap


def test_a_replica_killed_inside_the_backward_all_reduce_costs_its_peer_one_step_again(tmp_path, uninterrupted):
    # torchft's own DDP hook ended the survivor here with an AssertionError (distributed/live.py).
    # The replacement takes 2 s in build(), as a model loaded from disk does: its peer trains meanwhile.
    slow = {"DDPLAB_TEST_REPLACEMENT_S": "2", "DDPLAB_TEST_STEP_S": "0.3"}
    output, (survivor, lost) = _live_run(tmp_path, 2, "1:5:backward", env=slow)
    assert "AssertionError" not in output and "Traceback" not in output, output
    assert "replica 1 failed (exit code -9); starting its replacement" in output
    kept = _records(survivor)
    # the survivor never restarted, and trained every step once
    assert len({r["pid"] for r in kept}) == 1
    assert [r["step"] for r in kept] == list(range(1, STEPS + 1))
    # step 5's all_reduce failed with its peer: nobody committed it, and it was taken again
    assert kept[4]["attempts"] >= 2, kept[4]
    assert all(r["attempts"] == 1 for r in kept if r["step"] != 5)
    # alone while its peer's replacement started (test_live_parts: a replica is heard from its first quorum on)
    assert any(r["replicas"] == 1 for r in kept), kept
    facts = json.loads((survivor / "summary.json").read_text())["live"]
    assert facts["redone"] == kept[4]["attempts"] - 1 and facts["replicas_at_end"] == 2
    # every step's whole global batch, whoever was there
    assert all(r["samples"] == 32 for r in kept)
    replaced = _records(lost)
    assert len({r["pid"] for r in replaced}) == 2
    assert "replica 1 healed from a peer" in output
    # the replacement's first step is the one its peer was on: no step lost, none trained twice
    second_life = [r for r in replaced if r["pid"] != replaced[0]["pid"]]
    assert second_life[0]["step"] <= kept[-1]["step"] and second_life[-1]["step"] == STEPS
    _check_same_weights([survivor, lost], uninterrupted)


def test_a_heal_that_fails_ends_only_the_replica_that_was_healing_and_its_next_replacement_heals(
    tmp_path, uninterrupted
):
    marker = tmp_path / "heal-failed"
    # Steps of 0.5 s: the survivor is still training when the second replacement comes (a process that
    # imports torch and torchft). At 0.15 s, on a loaded machine, it had finished by then, and the
    # replacement trained the whole run alone.
    slow = {"DDPLAB_TEST_FAIL_HEAL": str(marker), "DDPLAB_TEST_STEP_S": "0.5"}
    output, (survivor, lost) = _live_run(tmp_path, 2, "1:5:backward", env=slow)
    assert marker.exists()
    assert "replica 1 left its quorum: copying the training state between it and a peer failed" in output
    assert "replica 1 failed (exit code 1); starting its replacement (2 of at most 3)" in output
    kept = _records(survivor)
    assert len({r["pid"] for r in kept}) == 1 and [r["step"] for r in kept] == list(range(1, STEPS + 1))
    assert len({r["pid"] for r in _records(lost)}) == 2
    _check_same_weights([survivor, lost], uninterrupted)


def test_three_replicas_one_killed_between_steps_the_others_go_on_and_shares_stay_exact(tmp_path, uninterrupted):
    # an evaluation every 5 steps: the kill comes after step 5's, before step 6's quorum; the
    # replacement waits 4 s, past the lost replica's 2 s heartbeat timeout (a replacement that started
    # within it, on a quiet machine, joined step 6's quorum and its peers never trained alone).
    # Replica 1 comes 3 s late to its first quorum: the replicas started together wait for it.
    output, folders = _live_run(
        tmp_path,
        3,
        "2:5:between",
        "trainer.eval_every=5",
        "trainer.accumulate=2",
        env={"DDPLAB_TEST_REPLACEMENT_S": "4", "DDPLAB_TEST_LATE": "1:3"},
    )
    survivors = [_records(f) for f in folders[:2]]
    for kept in survivors:
        # every step once, from step 1: the late replica was not left out of the first quorum
        assert len({r["pid"] for r in kept}) == 1
        assert [r["step"] for r in kept] == list(range(1, STEPS + 1))
        # they went on without it before its replacement came: 16 samples each of 32
        alone = [r for r in kept if r["replicas"] == 2]
        assert alone and all(r["own_samples"] == 16 for r in alone)
        # three shares of 32: 11, 11, 10
        assert {r["own_samples"] for r in kept if r["replicas"] == 3} <= {10, 11}
    assert "replica 2 healed from a peer" in output
    assert all(r["replicas"] == 3 for r in _records(folders[2])[-3:])
    # uneven shares, accumulation, a heal: still the uninterrupted run's weights
    _check_same_weights(folders, uninterrupted)
    # exact evaluation on every replica, the same metric
    evals = [[json.loads(line) for line in (f / "metrics.jsonl").read_text().splitlines()] for f in folders]
    last = [[r["eval/mse"] for r in rows if "eval/mse" in r][-1] for rows in evals]
    assert len(set(last)) == 1
    # each replica its own random stream, the healed one too (not its peer's)
    draws = [{r["step"]: r["train/draw"] for r in rows if "train/draw" in r} for rows in evals]
    for step in (STEPS - 5, STEPS):
        assert len({d[step] for d in draws}) == 3, [d[step] for d in draws]


def test_a_replacement_that_comes_after_its_peer_finished_ends_without_a_run_of_its_own(tmp_path):
    # held, before its experiment is made, until its peer's run has ended: nobody is left to heal
    # from, and the run is done
    peer_done = tmp_path / "replicated" / "live" / "replica-0" / "summary.json"
    output, (finisher, late) = _live_run(
        tmp_path, 2, "1:5:backward", env={"DDPLAB_TEST_REPLACEMENT_AFTER": str(peer_done)}
    )
    assert "replica 1 failed (exit code -9); starting its replacement" in output
    assert "replica 1 ends at step 0 without training on: replica(s) [0] finished the run" in output, output
    assert [r["step"] for r in _records(finisher)] == list(range(1, STEPS + 1))
    # the replacement took no step: the killed replica's four are all its folder holds
    assert [r["step"] for r in _records(late)] == [1, 2, 3, 4]
    assert not any((late / "final").iterdir())
    # listed as what it is, not as a run to resume
    assert run_status(str(late))["status"] == "superseded (replica(s) [0] finished the run)"


def test_a_replica_that_ends_before_its_first_quorum_does_not_hold_its_peer(tmp_path):
    # its peer waits for it at the start (up to dist.timeout_s), until the launcher says it ended
    env = clean_env(DDPLAB_TEST_FAIL_BUILD="1")
    args = ["run", TARGET, "-n", "2", "--max-restarts", "0", f"run.dir={tmp_path}", "run.name=alone", *COMMON]
    code, out, err = finish(start(*args, *LIVE, "dist.timeout_s=300", env=env), 90, "ddplab run (one left)")
    assert code == 0 and "replica(s) [1] ended with an error; [0] finished the run" in out, out + err
    kept = _records(tmp_path / "replicated" / "alone" / "replica-0")
    assert [r["step"] for r in kept] == list(range(1, STEPS + 1)) and {r["replicas"] for r in kept} == {1}


def test_a_lost_lighthouse_stops_every_replica_in_one_line_and_the_same_command_resumes(tmp_path):
    port = free_port()
    lighthouse = start("lighthouse", "--port", str(port), "--host", "127.0.0.1")
    args = [
        TARGET,
        "-n",
        "2",
        f"run.dir={tmp_path}",
        "run.name=lh",
        *COMMON,
        *LIVE,
        f"dist.lighthouse=http://127.0.0.1:{port}",
        "dist.timeout_s=5",
        "trainer.checkpoint_every=5",
    ]
    run = start("run", *args, env=clean_env(DDPLAB_TEST_STEP_S="0.15"))
    record = tmp_path / "replicated" / "lh" / "replica-0" / "live.jsonl"
    deadline = time.monotonic() + budget(60)
    while not (record.exists() and len(record.read_text().splitlines()) >= 12):
        assert time.monotonic() < deadline and run.poll() is None, "the replicas never trained"
        time.sleep(0.2)
    os.kill(lighthouse.pid, signal.SIGKILL)
    code, out, err = finish(run, 60, "ddplab run (lighthouse lost)")
    assert code == 2, out + err
    lost = [line for line in (out + err).splitlines() if "lost the lighthouse" in line]
    # each replica's one line, naming the fix
    assert len(lost) == 2 and all("run the same command" in line for line in lost), out + err
    assert "Traceback" not in out + err
    lighthouse = start("lighthouse", "--port", str(port), "--host", "127.0.0.1")
    try:
        res = ddplab("run", *args, timeout=90)
    finally:
        lighthouse.send_signal(signal.SIGTERM)
        finish(lighthouse, 20, "ddplab lighthouse")
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stdout.count("resumed from") == 2, res.stdout
    folders = [tmp_path / "replicated" / "lh" / f"replica-{r}" for r in range(2)]
    first, second = (_final(f) for f in folders)
    assert all(torch.equal(first[k], second[k]) for k in first)
    # `ddplab runs` lists each replica's run
    listed = ddplab_here("runs", str(tmp_path), "--json")
    rows = {row["run"]: row["status"] for row in json.loads(listed.stdout)}
    assert rows == {"lh/replica-0": "finished", "lh/replica-1": "finished"}, listed.stdout + listed.stderr


def _replicas_of(launcher: int) -> list[int]:
    """The replica processes a launcher started (its children that run ddplab's worker)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
            command = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == launcher and b"ddplab.launch.worker" in command:
            found.append(int(pid))
    return sorted(found)


@pytest.mark.timeout(300)
def test_a_stop_signal_to_one_replica_or_to_the_launcher_saves_every_replica_and_the_command_continues(
    tmp_path, uninterrupted
):
    args = [TARGET, "-n", "2", f"run.dir={tmp_path}", "run.name=stop", *COMMON, *LIVE]
    folders = [tmp_path / "replicated" / "stop" / f"replica-{r}" for r in range(2)]
    # SLURM's warning signal to one replica, then Kubernetes' SIGTERM to the launcher
    for sig, to, records in ((signal.SIGUSR1, "replica", 8), (signal.SIGTERM, "launcher", 20)):
        run = start("run", *args, env=clean_env(DDPLAB_TEST_STEP_S="0.15"))
        deadline = time.monotonic() + budget(60)
        while len(_records(folders[0]) if (folders[0] / "live.jsonl").exists() else []) < records:
            assert time.monotonic() < deadline and run.poll() is None, "the replicas never trained"
            time.sleep(0.2)
        os.kill(_replicas_of(run.pid)[0] if to == "replica" else run.pid, sig)
        code, out, err = finish(run, 60, f"ddplab run ({sig.name} to the {to})")
        assert code == 128 + sig, out + err
        assert "Traceback" not in out + err and "starting its replacement" not in out
        said = [line for line in err.splitlines() if line.startswith(f"ddplab: stopped by {sig.name}")]
        assert len(said) == 1, out + err
        for folder in folders:
            step = re.search(rf"{folder.name.replace('-', ' ')} saved a checkpoint at step (\d+) in {folder}", said[0])
            assert step, said[0]
            assert (folder / "checkpoints" / f"step-{int(step[1]):08d}").is_dir()
        assert said[0].endswith(f"To continue: ddplab run {' '.join(args)}"), said[0]
    res = ddplab("run", *args, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stdout.count("resumed from") == 2, res.stdout
    _check_same_weights(folders, uninterrupted)


def test_without_torchft_live_recovery_is_one_line_naming_the_extra(tmp_path):
    # a Python that cannot import torchft: a sitecustomize that hides it
    hide = tmp_path / "hide"
    hide.mkdir()
    (hide / "torchft.py").write_text("raise ImportError('No module named torchft')\n")
    env = clean_env(PYTHONPATH=f"{hide}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    res = ddplab("run", TARGET, "-n", "2", f"run.dir={tmp_path}", *COMMON, *LIVE, env=env, timeout=50)
    assert res.returncode == 2, res.stdout + res.stderr
    assert "pip install 'ddplab[ft]'" in res.stderr and "Traceback" not in res.stderr, res.stderr


def test_a_quorum_smaller_than_its_minimum_is_one_line_naming_the_replicas_not_the_lighthouse(tmp_path):
    args = [TARGET, "-n", "2", f"run.dir={tmp_path}", *COMMON, *LIVE, "dist.timeout_s=5"]
    # the launch's own lighthouse hears of its own replicas only: refused before anything starts
    res = ddplab("run", *args, "dist.min_replicas=3")
    assert res.returncode == 2 and "dist.min_replicas=3 needs that many replicas in each step, and -n 2" in res.stderr
    assert not any(tmp_path.iterdir())
    port = free_port()
    for least, settings, said in (
        # a lighthouse that forms quorums of 1: torchft would run each step and never commit it
        ("1", ["dist.min_replicas=3"], "found no quorum of dist.min_replicas=3 within dist.timeout_s=5 s: the "
         f"lighthouse at http://127.0.0.1:{port} forms quorums of 2"),
        # one that waits for 3: no quorum at all, while it answers
        ("3", [], "found no quorum within dist.timeout_s=5 s: the lighthouse at "
         f"http://127.0.0.1:{port} answers, and fewer replicas came to it"),
    ):  # fmt: skip
        lighthouse = start("lighthouse", "--port", str(port), "--host", "127.0.0.1", "--min-replicas", least)
        try:
            code, out, err = finish(
                start("run", *args, f"dist.lighthouse=http://127.0.0.1:{port}", *settings), 60, "ddplab run"
            )
        finally:
            lighthouse.send_signal(signal.SIGTERM)
            finish(lighthouse, 20, "ddplab lighthouse")
        lines = [line for line in (out + err).splitlines() if "ddplab: error:" in line]
        assert code == 2 and len(lines) == 2 and all(said in line for line in lines), out + err
        assert "lost the lighthouse" not in out + err and "Traceback" not in out + err


def test_replicas_that_cannot_reach_a_step_to_save_at_end_at_a_second_signal(tmp_path):
    port = free_port()
    lighthouse = start("lighthouse", "--port", str(port), "--host", "127.0.0.1", "--min-replicas", "3")
    try:
        args = [TARGET, "-n", "2", f"run.dir={tmp_path}", "run.name=wait", *COMMON, *LIVE]
        run = start("run", *args, f"dist.lighthouse=http://127.0.0.1:{port}", "dist.timeout_s=120")
        # both replicas wait for a third one to form a quorum
        folders = [tmp_path / "replicated" / "wait" / f"replica-{r}" for r in range(2)]
        deadline = time.monotonic() + budget(60)
        while not all(
            (f / "log.txt").exists() and "dist.fault_tolerance=live" in (f / "log.txt").read_text() for f in folders
        ):
            assert time.monotonic() < deadline and run.poll() is None, "the replicas never started"
            time.sleep(0.2)
        run.send_signal(signal.SIGTERM)
        time.sleep(1)
        assert run.poll() is None, "the replicas were told to save at their next step, and have none to take"
        run.send_signal(signal.SIGTERM)
        code, out, err = finish(run, 30, "ddplab run (stopped twice)")
    finally:
        lighthouse.send_signal(signal.SIGTERM)
        finish(lighthouse, 20, "ddplab lighthouse")
    assert code == 143, out + err
    said = [line for line in err.splitlines() if line.startswith("ddplab: stopped by SIGTERM")]
    assert len(said) == 1 and said[0].count("saved nothing at the stop") == 2, out + err
    assert "To continue: ddplab run" in said[0]
