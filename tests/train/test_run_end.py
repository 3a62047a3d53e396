"""The end of a run (train/ending.py): after the last step, on_fit_end and the export of final/ can
fail; the run then says which part failed in one line, keeps its last checkpoint, is listed as failed
at the end (not resumable), and the same command, once the part is fixed, trains no further and
redoes the end. Wall time counts training over the attempts, not the time a job was down."""

import json
import os

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

import ddplab
from ddplab.checkpoint.store import list_checkpoints
from ddplab.tools.listing import run_status
from ddplab.train.ending import EndOfRunError
from ddplab.train.summary import Run, training_time
from helpers import FIXTURES, ddplab_here, run_target

pytestmark = pytest.mark.timeout(60)


class Line(ddplab.Experiment):
    def build(self):
        self.net = nn.Linear(3, 1)
        self.opt = torch.optim.SGD(self.net.parameters(), lr=0.1)
        self.steps_taken = 0

    def train_dataset(self):
        g = torch.Generator().manual_seed(0)
        return TensorDataset(torch.randn(64, 3, generator=g), torch.randn(64, generator=g))

    def eval_dataset(self):
        return self.train_dataset()

    def training_step(self, batch):
        self.steps_taken += 1
        x, y = batch
        return ((self.net(x).squeeze(-1) - y) ** 2).mean()

    def evaluation_step(self, batch):
        x, y = batch
        return {"loss": (self.net(x).squeeze(-1) - y) ** 2}

    def on_fit_end(self):
        if os.path.exists(os.path.join(self.run_dir, "broken")):
            raise ValueError("a bug in on_fit_end")


def _fit(tmp_path, *overrides: str) -> Line:
    settings = ["run.name=r", f"run.dir={tmp_path}", "trainer.progress=false", "log.tensorboard=false"]
    exp = Line(ddplab.load_config(ddplab.Config, [*settings, "trainer.global_batch_size=8", *overrides]))
    exp.fit()
    return exp


@pytest.mark.parametrize("part", ["on_fit_end", "export"])
def test_a_failed_end_is_one_line_kept_listed_as_such_and_the_same_command_finishes_it(tmp_path, part):
    run = tmp_path / "line" / "r"
    run.mkdir(parents=True)
    # the user's bug, or a final/ that cannot be written
    broken = run / "broken" if part == "on_fit_end" else run / "final" / "model.safetensors"
    broken.mkdir(parents=True)
    with pytest.raises(EndOfRunError) as failed:
        _fit(tmp_path, "trainer.max_steps=6")
    what = "on_fit_end" if part == "on_fit_end" else "the export of final/"
    line = str(failed.value)
    assert "\n" not in line and line.startswith(f"{what} failed on rank 0 after training finished at step 6")
    assert "the checkpoint of step 6 is complete" in line and "run the same command again" in line
    assert [info.step for info in list_checkpoints(str(run / "checkpoints"))] == [6]
    assert run_status(str(run))["status"] == f"failed at the end ({part})"
    broken.rmdir()
    again = _fit(tmp_path, "trainer.max_steps=6")
    # nothing trained again: the run was at its length
    assert again.steps_taken == 0 and again.step == 6
    assert run_status(str(run))["status"] == "finished"
    assert (run / "final" / "model.safetensors").is_file()


@pytest.mark.slow
def test_a_failure_in_on_fit_end_on_two_ranks_shows_the_users_traceback_and_one_line(tmp_path):
    res = ddplab_here(
        "run",
        "tests/fixtures/experiments.py:Classifier",
        "-n",
        "2",
        f"run.dir={tmp_path}",
        "run.name=r",
        "trainer.progress=false",
        "log.tensorboard=false",
        "trainer.max_steps=4",
        "fault.fail_on_fit_end=true",
    )
    assert res.returncode == 2, res.stdout + res.stderr
    last = res.stderr.strip().splitlines()[-1]
    assert last.startswith("ddplab: error: on_fit_end failed on rank ") and "step 4" in last, res.stderr
    # the user's own line, where the bug is
    assert 'raise ValueError(f"a bug in on_fit_end on rank' in res.stderr
    listed = ddplab_here("runs", str(tmp_path), "--json")
    assert json.loads(listed.stdout)[0]["status"] == "failed at the end (on_fit_end)"


def test_wall_time_sums_each_attempt_to_its_last_line_and_counts_the_attempts():
    rows = [{"step": s, "time": t} for s, t in ((10, 105.0), (20, 110.0), (30, 5020.0), (40, 5030.0))]
    # the job was down from 110 to 5000
    run = Run("r", rows, {"started_at": 100.0, "attempts": [100.0, 5000.0]})
    assert training_time(run) == {"wall_s": 10.0 + 30.0, "attempts": 2}
    # an older run.json without attempts: its first start stands for them
    assert training_time(Run("r", rows, {"started_at": 100.0})) == {"wall_s": 4930.0, "attempts": 1}


def test_the_first_line_after_a_resume_says_how_many_steps_it_averages(tmp_path):
    _fit(tmp_path, "trainer.max_steps=12", "trainer.log_every=5", "trainer.checkpoint_every=12")
    _fit(tmp_path, "trainer.max_steps=20", "trainer.log_every=5")
    log = (tmp_path / "line" / "r" / "log.txt").read_text()
    lines = [line.split("  ")[0] for line in log.splitlines() if line.startswith("train step")]
    assert lines == [
        "train step 5",
        "train step 10",
        "train step 12 (mean of 2 steps)",
        "train step 15 (mean of 3 steps)",
        "train step 20",
    ]
    info = json.loads((tmp_path / "line" / "r" / "run.json").read_text())
    assert len(info["attempts"]) == 2 and info["started_at"] == info["attempts"][0]


TRAINING = ["build", "train_dataset", "eval_dataset", "training_step", "evaluation_step", "on_evaluation_end"]


@pytest.mark.timeout(90)
@pytest.mark.slow
def test_self_print_says_its_line_once_from_every_method_and_log_txt_keeps_the_runs_lines(tmp_path):
    # build() and the datasets run before the run's log opens, on_fit_end after its last line
    target = f"{FIXTURES / 'printing.py'}:Printing"
    quiet = ["trainer.progress=false", "log.tensorboard=false"]
    res = run_target(target, tmp_path, "p", "trainer.max_steps=4", "trainer.eval_every=2", *quiet)
    said = [line.split("said in ", 1)[1] for line in res.stdout.splitlines() if "said in " in line]
    # from rank 0 alone, once each
    assert said == [*TRAINING, "on_epoch_end", "on_fit_end"], res.stdout
    log = (tmp_path / "printing" / "p" / "log.txt").read_text().splitlines()
    kept = [line.split("said in ", 1)[1] for line in log if "said in " in line]
    assert kept == said, log
    # and in the commands that keep no log
    run = str(tmp_path / "printing" / "p")
    for command in (
        ["eval", target, "--checkpoint", run],
        ["predict", run, "--input", "eval", "--out", f"{tmp_path}/p.csv"],
    ):
        res = ddplab_here(*command)
        assert res.returncode == 0, res.stdout + res.stderr
        assert "said in build" in res.stdout and "Traceback" not in res.stderr, res.stdout + res.stderr


def test_a_hook_of_another_framework_is_named_once_with_what_ddplab_calls_instead(tmp_path):
    target = f"{FIXTURES / 'printing.py'}:LightningStyle"
    quiet = ["trainer.progress=false", "log.tensorboard=false", "trainer.max_steps=2"]
    res = ddplab_here("run", target, f"run.dir={tmp_path}", *quiet)
    assert res.returncode == 0, res.stdout + res.stderr
    warned = [line for line in res.stderr.splitlines() if "is not a ddplab hook" in line]
    assert warned == [
        "ddplab: warning: LightningStyle.validation_step is not a ddplab hook (ddplab never calls it); ddplab calls "
        "evaluation_step(batch), returning per-sample tensors",
        "ddplab: warning: LightningStyle.on_train_batch_end is not a ddplab hook (ddplab never calls it); ddplab calls "
        "training_step(batch), once per micro-batch",
    ], res.stderr
    assert "said in on_train_batch_end" not in res.stdout
    # ddplab's own hooks and an experiment without foreign ones: no word
    plain = ddplab_here("run", f"{FIXTURES / 'printing.py'}:Printing", f"run.dir={tmp_path}", *quiet)
    assert plain.returncode == 0 and "is not a ddplab hook" not in plain.stderr, plain.stderr
