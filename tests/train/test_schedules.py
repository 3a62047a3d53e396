"""Schedulers as users bring them (train/schedules.py): a ReduceLROnPlateau steps after each
evaluation with the monitored metric (not once per step without one: a TypeError at step 1 before),
exactly as torch's own would over the same metrics, and resumes bit for bit."""

import signal

import pytest
import torch
from torch import nn

import ddplab
from ddplab.errors import ConfigError
from ddplab.train.rundir import is_locked
from helpers import metrics_rows
from test_run_end import Line

pytestmark = pytest.mark.timeout(60)


class Plateau(Line):
    """test_run_end's linear regression, its rate halved when the evaluation's loss stops falling."""

    def build(self):
        super().build()
        self.opt = torch.optim.SGD(self.net.parameters(), lr=0.5)
        self.sched = torch.optim.lr_scheduler.ReduceLROnPlateau(self.opt, mode="min", factor=0.5, patience=0)


def _fit(tmp_path, *overrides: str) -> Plateau:
    settings = ["run.name=r", f"run.dir={tmp_path}", "trainer.progress=false", "log.tensorboard=false"]
    settings += ["trainer.global_batch_size=8", "trainer.eval_every=2", "trainer.log_every=2"]
    exp = Plateau(ddplab.load_config(ddplab.Config, [*settings, *overrides]))
    exp.fit()
    return exp


def _rows(tmp_path) -> list[dict]:
    return metrics_rows(tmp_path / "plateau" / "r")


def test_a_plateau_scheduler_steps_on_each_evaluations_monitored_metric(tmp_path):
    _fit(tmp_path, "trainer.max_steps=16", "checkpoint.monitor=loss", "checkpoint.mode=min")
    rows = _rows(tmp_path)
    evaluations = [row["eval/loss"] for row in rows if "eval/loss" in row]
    lrs = {row["step"]: row["train/lr"] for row in rows if "train/lr" in row}
    # torch's own scheduler fed the same metrics gives the rate each log line showed
    reference = torch.optim.lr_scheduler.ReduceLROnPlateau(
        torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.5), mode="min", factor=0.5, patience=0
    )
    expected = {}
    for step, loss in zip(range(2, 17, 2), evaluations, strict=True):
        # the line of step s shows the rate its steps trained at: set by the evaluation before it
        expected[step] = reference.optimizer.param_groups[0]["lr"]
        reference.step(loss)
    assert lrs == expected and len(set(lrs.values())) > 1


def test_a_resumed_plateau_run_is_the_straight_run_bit_for_bit(tmp_path):
    monitor = ("checkpoint.monitor=loss", "checkpoint.mode=min")
    straight = _fit(tmp_path / "a", "trainer.max_steps=16", *monitor)
    _fit(tmp_path / "b", "trainer.max_steps=8", "trainer.checkpoint_every=8", *monitor)
    resumed = _fit(tmp_path / "b", "trainer.max_steps=16", *monitor)
    assert resumed.opt.param_groups[0]["lr"] == straight.opt.param_groups[0]["lr"]
    assert resumed.sched.state_dict() == straight.sched.state_dict()
    assert all(torch.equal(a, b) for a, b in zip(resumed.net.parameters(), straight.net.parameters(), strict=True))


def test_a_plateau_scheduler_without_a_monitored_metric_is_one_line_before_training(tmp_path):
    handler = signal.getsignal(signal.SIGTERM)
    with pytest.raises(ConfigError, match=r"a ReduceLROnPlateau scheduler steps on an evaluation metric") as e:
        _fit(tmp_path, "trainer.max_steps=4")
    assert "checkpoint.monitor=METRIC" in str(e.value)
    assert not (tmp_path / "plateau" / "r" / "metrics.jsonl").exists() or not _rows(tmp_path)
    # nothing of the refused run is left in the session (a notebook): other jobs find its folder
    # free, and the session's own SIGTERM handler is back
    assert not is_locked(str(tmp_path / "plateau" / "r")) and signal.getsignal(signal.SIGTERM) is handler
    # and a session that fixes the setting trains in the same folder
    assert _fit(tmp_path, "trainer.max_steps=4", "checkpoint.monitor=loss", "checkpoint.mode=min").step == 4
