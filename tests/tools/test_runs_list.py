"""`ddplab runs`: every run of a run.dir with the status its files show, for a person or a script."""

import fcntl
import json

import pytest

from helpers import ddplab, ddplab_here, summary_of

EXP = "tests/fixtures/experiments.py:Classifier"
COMMON = ["trainer.progress=false", "log.tensorboard=false", "trainer.global_batch_size=32"]
pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


def test_runs_lists_each_run_with_the_status_its_files_show(tmp_path):
    # the files a run leaves are rank 0's, whatever the world size: one process (no launcher) each
    def train(name, *args):
        command = ["run", EXP, f"run.dir={tmp_path}", f"run.name={name}", *COMMON, *args]
        # a run that SIGKILLs itself needs a process of its own
        return ddplab(*command, timeout=90) if "fault.die_at_step=5" in args else ddplab_here(*command)

    assert train("done", "trainer.max_steps=4", "checkpoint.monitor=accuracy").returncode == 0
    # SIGKILLed after step 5
    assert train("killed", "trainer.max_steps=8", "trainer.checkpoint_every=2", "fault.die_at_step=5").returncode
    # raises in step 1
    assert train("crashed", "trainer.max_steps=8", "fault.raise_at_step=1").returncode
    assert train("busy", "trainer.max_steps=2").returncode == 0
    # a job training in it right now
    holder = open(tmp_path / "classifier" / "busy" / ".lock", "a+")  # noqa: SIM115 (held: the lock lasts while it is open)
    fcntl.flock(holder, fcntl.LOCK_EX | fcntl.LOCK_NB)

    listed = ddplab_here("runs", str(tmp_path), "--json")
    rows = {r["run"]: r for r in json.loads(listed.stdout)}
    assert {name: (r["status"], r["checkpoint"]) for name, r in rows.items()} == {
        "busy": ("running", 2),
        "crashed": ("failed", None),
        "done": ("finished", 4),
        "killed": ("killed (resumable)", 4),
    }
    done = summary_of(tmp_path / "classifier" / "done")
    assert rows["done"]["best"] == done["best"] and rows["done"]["best"]["metric"] == "accuracy"

    # that job ended: the same folder is finished now
    holder.close()
    table = ddplab_here("runs", str(tmp_path)).stdout.splitlines()
    assert table[0].split()[:5] == ["experiment", "run", "status", "step", "best"] and len(table) == 5
    assert [line.split()[2] for line in table[1:]] == ["finished", "failed", "finished", "killed"]
    assert f"accuracy {done['best']['value']:.4g}" in table[3]


def test_a_folder_without_runs_is_one_line(tmp_path):
    res = ddplab_here("runs", str(tmp_path))
    assert res.returncode == 2 and res.stderr.strip() == (
        f"ddplab: error: no runs in {tmp_path}; pass the run.dir the runs were written to (default: runs)"
    )
