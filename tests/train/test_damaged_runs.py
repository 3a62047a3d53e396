"""A run folder changes only when a run really proceeds; damaged metadata is named, skipped, and
never fatal to the tools (issue class: a refused or changed resume)."""

import json
import os

import pytest

from ddplab.checkpoint.store import list_checkpoints
from helpers import ddplab_here

EXP = "tests/fixtures/experiments.py:Classifier"
COMMON = ["trainer.progress=false", "log.tensorboard=false", "trainer.global_batch_size=32"]
pytestmark = pytest.mark.timeout(60)


def _run(tmp_path, *args, name="r"):
    return ddplab_here("run", EXP, f"run.dir={tmp_path}", f"run.name={name}", *COMMON, *args)


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_a_refused_resume_leaves_the_run_record_as_it_was(tmp_path):
    assert _run(tmp_path, "trainer.max_steps=4").returncode == 0
    run = tmp_path / "classifier" / "r"
    before = {name: (run / name).read_text() for name in ("config.yaml", "run.json")}
    refused = _run(tmp_path, "trainer.max_steps=8", "model.hidden=32")
    assert refused.returncode == 2 and "does not fit network 'net'" in refused.stderr, refused.stderr
    assert {name: (run / name).read_text() for name in before} == before
    # the run's own record still continues it
    assert _run(tmp_path, "trainer.max_steps=8").returncode == 0


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_damaged_checkpoint_metadata_is_named_skipped_and_never_fatal(tmp_path):
    assert _run(tmp_path, "trainer.max_steps=8", "trainer.checkpoint_every=4", "checkpoint.keep_last=3").returncode == 0
    run = tmp_path / "classifier" / "r"
    latest = run / "checkpoints" / "step-00000008"
    (latest / "meta.json").write_text("{}")
    listed = ddplab_here("checkpoints", str(run))
    assert listed.returncode == 0, listed.stderr
    assert "step-00000004" in listed.stdout and "step-00000008" not in listed.stdout
    assert f"checkpoint {latest} has a damaged meta.json (no field 'step'); it is skipped" in listed.stderr
    # a second run whose summary is damaged: the overview still lists both
    assert _run(tmp_path, "trainer.max_steps=2", name="other").returncode == 0
    (tmp_path / "classifier" / "other" / "summary.json").write_text(json.dumps({"best": 3, "status": "finished"}))
    overview = ddplab_here("runs", str(tmp_path))
    assert overview.returncode == 0, overview.stderr
    lines = overview.stdout.splitlines()
    rows = {line.split()[1]: line for line in lines[1:]}
    assert set(rows) == {"r", "other"} and "damaged" in rows["other"], overview.stdout
    # the resume takes the last checkpoint it can trust, and says why
    resumed = _run(tmp_path, "trainer.max_steps=12")
    assert resumed.returncode == 0, resumed.stderr
    assert "at step 4" in resumed.stdout and "damaged meta.json" in resumed.stderr
    assert [info.step for info in list_checkpoints(str(run / "checkpoints"))][-1] == 12


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_special_files_where_a_runs_files_should_be_never_block_the_listing(tmp_path):
    """A FIFO blocks whoever opens it for reading until a writer comes: `ddplab runs` and `ddplab
    report` look at what is a regular file only."""
    a, b = tmp_path / "exp" / "a", tmp_path / "exp" / "b"
    (a / "checkpoints" / "step-00000002").mkdir(parents=True)
    b.mkdir()
    (a / "run.json").write_text("{}")
    (a / "metrics.jsonl").write_text('{"step": 1, "time": 1.0, "train/loss": 0.5}\n')
    for fifo in (a / "summary.json", a / "config.yaml", a / ".lock", a / "checkpoints" / "step-00000002" / "meta.json"):
        os.mkfifo(fifo)
    os.mkfifo(b / "run.json")
    listed = ddplab_here("runs", str(tmp_path))
    assert listed.returncode == 0, listed.stderr
    rows = {line.split()[1]: line for line in listed.stdout.splitlines()[1:]}
    assert set(rows) == {"a", "b"} and "failed" in rows["a"]
    reported = ddplab_here("report", str(a))
    assert reported.returncode == 0 and "1 steps" in reported.stdout, reported.stderr
