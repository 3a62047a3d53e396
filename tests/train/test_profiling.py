"""trainer.profile (train/profiling.py): real ranks over gloo profiled over a window of steps, one
trace per rank holding exactly the window's steps, rank 0's table, training that profiling leaves
bit for bit as it was, and every bad window or folder ending in one line before training. What
ranks share is the first test's; the others, about one rank's window, run one process."""

import json

import pytest
from safetensors.torch import load_file

from helpers import ddplab, ddplab_here, run_target

TARGET = "tests/fixtures/experiments.py:Classifier"
COMMON = ["trainer.progress=false", "log.tensorboard=false", "trainer.max_steps=40"]
pytestmark = pytest.mark.timeout(60)


def _final(tmp_path, name):
    (weights,) = (tmp_path / "classifier" / name / "final").glob("*.safetensors")
    return load_file(weights)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_every_rank_writes_a_trace_of_exactly_the_window_and_training_is_unchanged(tmp_path):
    res = run_target(TARGET, tmp_path, "profiled", *COMMON, "trainer.profile=20:25")
    run_target(TARGET, tmp_path, "plain", *COMMON)
    folder = tmp_path / "classifier" / "profiled" / "profile"
    for rank in (0, 1):
        events = json.loads((folder / f"trace_rank{rank}.json").read_text())["traceEvents"]
        steps = sorted({e["name"] for e in events if e.get("name", "").startswith("ProfilerStep#")})
        assert steps == [f"ProfilerStep#{n}" for n in range(21, 26)]
        assert "DistributedDataParallel.forward" in (folder / f"operators_rank{rank}.txt").read_text()
    # rank 0's report, once, with the window's shares and its operators
    assert res.stdout.count("profile of steps 21-25: one trace per rank in") == 1
    assert "waiting for data" in res.stdout and "% (DDP overlaps it with the backward)" in res.stdout
    assert "self time   share   calls  operator" in res.stdout
    profiled, plain = _final(tmp_path, "profiled"), _final(tmp_path, "plain")
    assert all((profiled[k] == plain[k]).all() for k in plain)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_folder_that_breaks_mid_window_costs_the_profile_not_the_training(tmp_path):
    folder = tmp_path / "traces"
    res = run_target(
        TARGET, tmp_path, "r", *COMMON, "trainer.profile=10:20", f"trainer.profile_dir={folder}",
        "fault.clobber_at_step=15", f"fault.clobber_path={folder}", n=1,
    )  # fmt: skip
    assert "step 20: profiling stopped (" in res.stdout + res.stderr
    assert "training goes on without it" in res.stdout + res.stderr
    assert '"step": 40' in (tmp_path / "classifier" / "r" / "metrics.jsonl").read_text()


@pytest.mark.parametrize(
    "window,message",
    [
        ("25:20", "trainer.profile=25:20 is reversed"),
        ("20:20", "trainer.profile=20:20 is empty"),
        ("20-25", "config key 'trainer.profile' is '20-25', but it must be START:END"),
        ("30:50", "trainer.profile=30:50 ends after the run's last step (40)"),
    ],
)
def test_a_bad_window_is_one_line_before_training(tmp_path, window, message):
    res = ddplab_here("run", TARGET, "-n", "2", f"run.dir={tmp_path}", *COMMON, f"trainer.profile={window}")
    assert res.returncode == 2, res.stdout + res.stderr
    (line,) = [line for line in res.stderr.splitlines() if line]
    assert message in line
    assert "train step" not in res.stdout


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_window_past_a_run_counted_in_epochs_is_one_line(tmp_path):
    # 512 samples / 32 = 16 steps: known once the data is read
    res = ddplab(
        "run", TARGET, f"run.dir={tmp_path}", "trainer.progress=false", "trainer.max_epochs=1",
        "trainer.profile=10:20", timeout=60,
    )  # fmt: skip
    assert res.returncode == 2, res.stdout + res.stderr
    assert "trainer.profile=10:20 ends after the run's last step (16)" in res.stderr
    assert "train step" not in res.stdout


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_trace_folder_that_cannot_be_made_is_one_line(tmp_path):
    (tmp_path / "file").write_text("")
    res = ddplab(
        "run", TARGET, f"run.dir={tmp_path}", *COMMON, "trainer.profile=5:10",
        f"trainer.profile_dir={tmp_path / 'file' / 'traces'}", timeout=60,
    )  # fmt: skip
    assert res.returncode == 2, res.stdout + res.stderr
    assert f"the profile folder {tmp_path / 'file' / 'traces'} cannot be written" in res.stderr
    assert "train step" not in res.stdout


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_run_resumed_past_the_window_says_so_and_trains_on(tmp_path):
    run_target(TARGET, tmp_path, "r", *COMMON[:2], "trainer.max_steps=30", n=1)
    res = run_target(TARGET, tmp_path, "r", *COMMON, "trainer.profile=20:25", n=1)
    assert (
        "trainer.profile=20:25 is not profiled: the run resumed at step 30, past its start "
        "(profile later steps, e.g. trainer.profile=31:36)" in res.stdout
    )
    assert not (tmp_path / "classifier" / "r" / "profile").exists()
    assert '"step": 40' in (tmp_path / "classifier" / "r" / "metrics.jsonl").read_text()
