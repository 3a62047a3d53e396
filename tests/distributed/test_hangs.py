"""Ranks that disagree about collectives: a clear error naming the collective and the ranks, with
every rank's stack, instead of a silent hang."""

import subprocess
import sys
import time

import pytest

from helpers import ddplab_here, finish, start

pytestmark = [pytest.mark.slow, pytest.mark.timeout(60)]


def _error_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.startswith("ddplab: error:")]
    assert len(lines) == 1, stderr
    return lines[0]


def test_a_skipped_all_reduce_is_reported_with_ranks_and_stacks():
    res = ddplab_here("run", "tests/fixtures/hang.py:skip_all_reduce", "-n", "2", "dist.timeout_s=5")
    assert res.returncode == 2, res.stderr
    line = _error_line(res.stderr)
    assert "all_reduce (hang.py:19 in skip_all_reduce) timed out on rank 0 after 5 s (dist.timeout_s)" in line
    assert "rank 1 not in a collective (hang.py:17 in skip_all_reduce)" in line
    assert "dist.debug=detail" in line
    assert "---- rank 0 (" in res.stderr and "---- rank 1 (" in res.stderr
    # rank 1's own stack shows where it is
    assert "time.sleep(60)" in res.stderr
    # stacks printed once, not by every rank
    assert res.stderr.count("---- rank 1 (") == 1


def test_debug_detail_names_the_mismatched_collectives_at_once():
    res = ddplab_here(
        "run",
        "tests/fixtures/hang.py:skip_then_barrier",
        "-n",
        "2",
        "dist.timeout_s=30",
        "dist.debug=detail",
    )
    assert res.returncode == 2, res.stderr
    line = _error_line(res.stderr)
    assert "ranks called different collectives (found by dist.debug=detail)" in line
    # rank 0, whichever rank reports
    assert "in all_reduce (hang.py:29 in skip_then_barrier)" in line
    # rank 1
    assert "in barrier (hang.py:30 in skip_then_barrier)" in line
    # found by torch's check, not by waiting out dist.timeout_s
    assert "timed out" not in line


EXP = "tests/fixtures/experiments.py:Classifier"
TRAIN = ["trainer.progress=false", "log.tensorboard=false", "trainer.global_batch_size=32", "dist.timeout_s=5"]


def test_inside_an_experiment_a_rank_that_stops_answering(tmp_path):
    """Rank 1 sleeps in its step while rank 0 waits in DDP's gradient all_reduce: without any
    debug setting, the job ends within the timeout with both ranks named."""
    res = ddplab_here(
        "run",
        EXP,
        "-n",
        "2",
        f"run.dir={tmp_path}",
        *TRAIN,
        "trainer.max_steps=20",
        "fault.stall_at_step=3",
        "dist.flight_recorder=true",
    )
    assert res.returncode == 2, res.stderr
    line = _error_line(res.stderr)
    assert "DDP's gradient all_reduce (in backward) timed out on rank 0 after 5 s" in line
    assert "rank 1 not in a collective (experiments.py:" in line and "in _inject_faults)" in line
    # rank 1's stack, printed once
    assert "time.sleep(20)" in res.stderr
    # rank 0 failed, so the agent's SIGTERM ended rank 1 in its sleep: not a stop to save at the
    # next step, which it would have reached only to find rank 0 gone
    assert "slept through" not in res.stdout + res.stderr
    # torch's flight recorder of each rank, where the line says, read by torch's own tool
    (folder,) = tmp_path.glob("classifier/*/flight_recorder")
    assert f"are in {folder}: `torchfrtrace {folder}`" in line
    assert sorted(p.name for p in folder.iterdir()) == ["rank_0", "rank_1"]
    read = subprocess.run(
        [sys.executable, "-m", "torch.distributed.flight_recorder.fr_trace", str(folder)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert "Not all ranks joining collective" in read.stdout + read.stderr, read.stderr
    assert "missing ranks: {1}" in read.stdout + read.stderr


def test_inside_an_experiment_a_rank_that_had_already_finished(tmp_path):
    """Rank 0 calls one all_reduce more than rank 1 at the end of training."""
    res = ddplab_here(
        "run",
        EXP,
        "-n",
        "2",
        f"run.dir={tmp_path}",
        *TRAIN,
        "trainer.max_steps=4",
        "fault.extra_collective_at_end=true",
    )
    assert res.returncode == 2, res.stderr
    line = _error_line(res.stderr)
    assert "rank 0 was in all_reduce (experiments.py:" in line and "in on_fit_end)" in line
    assert "while rank(s) [1] had already finished" in line
    # gloo keeps no flight recorder unless asked (it costs a small CPU step about 5 %), and says so
    assert "dist.flight_recorder=true would also keep each rank's last collectives" in line
    assert not list(tmp_path.glob("classifier/*/flight_recorder"))


def test_a_script_whose_ranks_leave_each_other_gets_the_same_named_error_within_the_timeout():
    """ddplab.init() in a plain script joins with the dist.* settings of its command line, so the
    wait is bounded by dist.timeout_s and diagnosed as inside an Experiment."""
    started = time.monotonic()
    res = ddplab_here("run", "tests/fixtures/leave_script.py", "-n", "2", "dist.timeout_s=5")
    lines = [line for line in res.stderr.splitlines() if line.startswith("ddplab: error")]
    assert res.returncode == 2 and len(lines) == 1, res.stdout + res.stderr
    assert time.monotonic() - started < 45
    assert "all_reduce (leave_script.py:14 in <module>) timed out on rank 0 after 5 s (dist.timeout_s)" in lines[0]
    assert "rank 1 not in a collective (leave_script.py:16 in <module>)" in lines[0]


CROSSED = "tests/fixtures/crossed_script.py"
# where each rank of crossed_script.py waits, by its flags
WAITS = {
    "": "in broadcast (crossed_script.py:33 in <module>)",
    "--barrier": "in barrier (crossed_script.py:27 in <module>)",
    "--recv": "in recv (crossed_script.py:29 in <module>)",
    "--none": "not in a collective (crossed_script.py:31 in <module>)",
}
ALL_REDUCE = "all_reduce (crossed_script.py:22 in <module>)"


@pytest.mark.parametrize(
    ("module", "args"),
    [
        ("ddplab", ["run", CROSSED, "-n", "2"]),
        ("ddplab", ["run", CROSSED, "-n", "2", "--own"]),
        ("torch.distributed.run", ["--nproc-per-node", "2", CROSSED]),
        # rank 0 times out first, and rank 1 learns of it as a lost peer
        ("ddplab", ["run", CROSSED, "-n", "2", "--late"]),
        ("torch.distributed.run", ["--nproc-per-node", "2", CROSSED, "--late"]),
        # a collective against a barrier, a point-to-point, nothing; in the script's own group too
        ("ddplab", ["run", CROSSED, "-n", "2", "--barrier"]),
        ("ddplab", ["run", CROSSED, "-n", "2", "--own", "--barrier"]),
        ("ddplab", ["run", CROSSED, "-n", "2", "--recv"]),
        ("ddplab", ["run", CROSSED, "-n", "2", "--own", "--none"]),
    ],
    ids=[
        "ddplab-init",
        "own-group",
        "torchrun-ddplab-init",
        "late",
        "torchrun-late",
        "barrier",
        "own-barrier",
        "recv",
        "own-none",
    ],
)
def test_a_script_whose_ranks_wait_in_different_collectives_is_told_which_each_was_in(module, args):
    """A plain script's ranks in different collectives (or one in none) time out; the first to
    report says what every rank was in, under ddplab's launcher (with ddplab.init() or its own
    process group) and under torchrun (with ddplab.init()), never a traceback from each rank."""
    code, out, err = finish(start(*args, module=module), 50, " ".join(args))
    lines = [line for line in err.splitlines() if "ddplab: error:" in line]
    assert code != 0 and lines, out + err
    waits = {0: f"in {ALL_REDUCE}", 1: next((w for flag, w in WAITS.items() if flag in args), WAITS[""])}
    # either rank may time out first (both wait 5 s), and the other may see its peer's connections
    # close before its own wait ends: each line names its own collective first and the other
    # rank's after it
    own = {
        rank: (
            f"{waits[rank][3:]} timed out on rank {rank} after 5 s",
            f"{waits[rank][3:]} on rank {rank} ended when rank(s) [{1 - rank}] timed out after 5 s",
        )
        for rank in (0, 1)
    }
    said = [
        rank
        for line in lines
        for rank in (0, 1)
        if any(line.split("ddplab: error: ")[1].startswith(o) for o in own[rank])
        and f"rank {1 - rank} {waits[1 - rank]}" in line
    ]
    assert said and len(said) == len(lines), lines
    assert "did not answer" not in lines[0]
    # nor torch's warning, on each rank, of a deprecated variable ddplab used to set
    assert "TORCH_NCCL_TRACE_BUFFER_SIZE is deprecated" not in err
    assert "[rank0]: Traceback" not in err and 'Traceback (most recent call last):\n  File "' + CROSSED not in err
