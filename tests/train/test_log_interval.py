"""The log interval and its heartbeat, timed by a clock the test moves: throughput, how often the
ranks agree (about once per second whatever the step time), when a stop signal lands, the memory
bound on kept losses, and which step a NaN after a resume is blamed on.

The clock stands for `time` in train/intervals.py and for the experiment's sleep, so a "step" of
0.25 s takes no time and every figure below is exact. The runs are the in-process ones of
test_loop_reference.py: no group, or a gloo group of one (the distributed path of the heartbeat).
"""

import json
import os
import traceback

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import ddplab
import test_loop_reference
from ddplab.checkpoint.store import list_checkpoints
from ddplab.config import DistConfig
from ddplab.errors import DdplabError
from ddplab.train import intervals
from ddplab.train import step as step_module
from ddplab.train.metrics import FOLD
from helpers import cuda_case
from test_loop_reference import Reference, Regression, config, logged

pytestmark = pytest.mark.timeout(60)


class Clock:
    """perf_counter, time and sleep of a clock that moves only when the experiment sleeps. Powers
    of two keep every difference exact."""

    def __init__(self):
        self.now = 0.5

    def perf_counter(self) -> float:
        return self.now

    def time(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def clock(monkeypatch):
    moved = Clock()
    monkeypatch.setattr(intervals, "time", moved)
    monkeypatch.setattr(step_module, "time", moved)
    monkeypatch.setattr(test_loop_reference, "time", moved)
    return moved


class Watched(Regression):
    """Records, as each step begins, how many steps apart beats go and how many losses wait."""

    def build(self):
        super().build()
        self.every: list[int] = []
        self.kept: list[int] = []
        # the training lines in metrics.jsonl as each step begins
        self.written: list[int] = []

    def training_step(self, batch):
        if len(self.seen) % self.plan.accumulate == 0:
            self.every.append(self.trainer.intervals.every)
            with open(os.path.join(self.run_dir, "metrics.jsonl")) as f:
                self.written.append(sum('"train/loss"' in line for line in f))
        self.kept.append(len(self.trainer.intervals.losses))
        return super().training_step(batch)


def run(tmp_path, *overrides: str) -> Watched:
    exp = Watched(config(tmp_path, *overrides))
    exp.fit()
    return exp


def test_throughput_is_the_interval_samples_over_its_time(tmp_path, world, clock):
    exp = run(tmp_path, "trainer.max_steps=6", "trainer.log_every=2", "step_sleep=0.3125")
    train = logged(exp, "train/")
    assert sorted(train) == [2, 4, 6]
    for step in (2, 4, 6):
        # 2 steps of 8 samples in 0.625 s, each line stamped with its own time
        assert train[step]["samples_per_s"] == pytest.approx(2 * 8 / 0.625, rel=1e-12)
    with open(os.path.join(exp.run_dir, "metrics.jsonl")) as f:
        times = {r["step"]: r["time"] for r in map(json.loads, f) if "train/loss" in r}
    assert times == {2: 1.125, 4: 1.75, 6: 2.375}


class SlowData(Watched):
    """Each sample takes 1/16 s to read (half a second a batch of 8); a sample is 3 tokens."""

    def train_dataset(self):
        return _Slow(super().train_dataset())

    def count_tokens(self, batch):
        return 3 * len(batch[0])


class _Slow(torch.utils.data.Dataset):
    def __init__(self, data):
        self.data = data

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        test_loop_reference.time.sleep(1 / 16)
        return self.data[i]


def test_the_share_of_time_waiting_for_data_and_tokens_per_second(tmp_path, world, clock):
    """Steps of 0.5 s reading data and 0.25 s computing: 2/3 of the time is waiting for data."""
    exp = SlowData(config(tmp_path, "trainer.max_steps=6", "trainer.log_every=2", "step_sleep=0.25"))
    exp.fit()
    train = logged(exp, "train/")
    for step in (2, 4, 6):
        assert train[step]["data_wait"] == pytest.approx(2 / 3, rel=1e-12)
        assert train[step]["samples_per_s"] == pytest.approx(2 * 8 / 1.5, rel=1e-12)
        assert train[step]["tokens_per_s"] == pytest.approx(3 * 2 * 8 / 1.5, rel=1e-12)
    assert (
        "tokens_per_s"
        not in logged(
            run(tmp_path / "plain", "trainer.max_steps=2", "trainer.log_every=2"),
            # an experiment that counts no tokens shows none
            "train/",
        )[2]
    )


def test_throughput_after_a_resume_counts_from_the_resumed_step(tmp_path, clock):
    run(tmp_path, "trainer.max_steps=4", "trainer.log_every=3", "step_sleep=0.5")
    exp = run(tmp_path, "trainer.max_steps=9", "trainer.log_every=3", "step_sleep=0.5")
    train = logged(exp, "train/")
    # steps 5 and 6: 16 samples in 1 s
    assert train[6]["samples_per_s"] == pytest.approx(2 * 8 / 1.0)
    assert train[9]["samples_per_s"] == pytest.approx(3 * 8 / 1.5)


@pytest.mark.parametrize(
    "step_s, every",
    [
        # a beat about once a second: every 4 steps
        (0.25, 4),
        (0.0625, 16),
        # slower steps than a second: every step
        (2.0, 1),
        # no measurable time: at most 1000 steps apart
        (0.0, 1000),
    ],
)
# without a group there is no beat to time
@pytest.mark.parametrize("world", ["gloo"], indirect=True)
def test_the_heartbeat_comes_about_once_a_second_whatever_the_step_time(tmp_path, world, clock, step_s, every):
    """Evaluations every 4 steps write their lines at once (their time is not step time); a beat
    right after one has no steps to time and keeps the period."""
    exp = run(tmp_path, "trainer.max_steps=40", "n_train=800", f"step_sleep={step_s}", "trainer.eval_every=4")
    # the first beat goes after step 1 and comes back after step 2; from step 3 on, its period
    assert exp.every == [1, 1] + [every] * 38


@pytest.mark.parametrize("signal_at, stopped_at", [(1, 2), (5, 9), (8, 9), (9, 13)])
def test_a_stop_signal_stops_at_the_step_after_the_next_beat(tmp_path, world, clock, signal_at, stopped_at):
    """With steps of 0.25 s the beats go after steps 1, 4, 8, 12...; each is read a step later.
    Without a group the signal needs no agreement: the run stops at that very step."""
    stopped_at = stopped_at if world == "gloo" else signal_at
    exp = run(tmp_path, "trainer.max_steps=20", "n_train=800", "step_sleep=0.25", f"signal_at_step={signal_at}")
    assert exp.step == stopped_at and exp.trainer.preempted
    assert [c.step for c in list_checkpoints(os.path.join(exp.run_dir, "checkpoints"))] == [stopped_at]


@pytest.mark.parametrize("accumulate, most", [(1, FOLD - 1), (3, FOLD + 1)])
def test_kept_losses_are_folded_as_soon_as_they_reach_the_bound(tmp_path, world, accumulate, most):
    """log_every larger than the run: without folding, every micro-batch's loss would wait for the
    end. Three micro-batches a step never land exactly on the bound: 255, then 258 are folded."""
    steps = 300 // accumulate
    exp = run(
        tmp_path,
        f"trainer.max_steps={steps}",
        "trainer.log_every=1000",
        f"trainer.accumulate={accumulate}",
        f"trainer.global_batch_size={2 * accumulate}",
        "n_train=600",
    )
    assert max(exp.kept) == most
    # and the logged loss is still the mean of all
    ref = Reference(exp).train(exp.seen, accumulate)
    all_losses = [v for step in ref.losses for v in step]
    assert logged(exp, "train/")[steps]["loss"] == pytest.approx(sum(all_losses) / len(all_losses), rel=1e-5)


@pytest.mark.parametrize("resumed_at, nan_at", [(6, 7), (6, 8), (7, 9)])
def test_a_nan_in_the_first_interval_after_a_resume_names_its_step(tmp_path, world, resumed_at, nan_at):
    run(tmp_path, f"trainer.max_steps={resumed_at}", "trainer.log_every=5")
    with pytest.raises(DdplabError, match=rf"not a finite number .* at step {nan_at} on rank 0"):
        run(tmp_path, "trainer.max_steps=12", "trainer.log_every=5", f"nan_at_step={nan_at}")


def test_each_step_is_logged_once_also_when_the_run_ends_on_a_log_step(tmp_path, world):
    """The last step closes its interval in the loop, and the end of training closes it again:
    that second time must add nothing."""
    exp = run(tmp_path, "trainer.max_steps=15", "trainer.log_every=5")
    with open(os.path.join(exp.run_dir, "metrics.jsonl")) as f:
        steps = [r["step"] for r in map(json.loads, f) if any(k.startswith("train/") for k in r)]
    assert steps == [5, 10, 15]


def test_without_a_group_lines_are_written_at_the_pace_of_the_beat(tmp_path, clock):
    """No one to agree with, but each write costs (the host work of packing and writing, and on a GPU a
    host sync): lines go about once a second, as with a group. Steps of 0.25 s, a line every 2 steps:
    the line of step 2 at once (the first beat), then those of steps 4, of 6 and 8, each at a beat."""
    exp = run(tmp_path, "trainer.max_steps=12", "trainer.log_every=2", "step_sleep=0.25", "n_train=800")
    # lines written as each step begins
    assert exp.written == [0, 0, 1, 1, 2, 2, 2, 2, 4, 4, 4, 4]
    # all of them, in the end
    assert sorted(logged(exp, "train/")) == [2, 4, 6, 8, 10, 12]


@pytest.mark.parametrize("nan_at", [6, 7, 10])
def test_a_nan_after_an_odd_log_interval_names_its_step(tmp_path, world, nan_at):
    """Intervals of 5 steps: each hand-over starts the next one at the step after its end."""
    with pytest.raises(DdplabError, match=rf"not a finite number .* at step {nan_at} on rank 0"):
        run(tmp_path, "trainer.max_steps=12", "trainer.log_every=5", f"nan_at_step={nan_at}")


def test_the_share_of_time_waiting_for_data_is_shown_as_a_percentage():
    from ddplab.train.logs import format_metrics

    line = format_metrics({"loss": 0.123456, "data_wait": 0.000212, "note": "x"})
    assert line == "loss 0.1235  data_wait 0.0%  note x"
    assert format_metrics({"data_wait": 0.25}) == "data_wait 25.0%"


class HostReads(TorchDispatchMode):
    """Where a tensor's value was read on the host (`.item()`, `bool(t)`, `if t:`): on CUDA each
    such read waits for the GPU. The data loader's own reads (its sampler, on the CPU) are left out."""

    def __init__(self):
        super().__init__()
        self.where: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            frames = traceback.extract_stack()[:-1]
            if not any(os.path.join("utils", "data") in f.filename for f in frames):
                ours = [f for f in frames if os.sep + "torch" + os.sep not in f.filename]
                self.where.append(" > ".join(f"{os.path.basename(f.filename)}:{f.lineno}" for f in ours[-3:]))
        return func(*args, **(kwargs or {}))


class Counted(Regression):
    def count_tokens(self, batch):
        # counted on the device: the log line must not read it step by step
        return (batch[0] != 0).sum()


@pytest.mark.parametrize("device", ["cpu", cuda_case()])
def test_a_log_interval_costs_one_host_sync_and_a_step_none(tmp_path, monkeypatch, device):
    """20 steps, a line every 5, tokens counted on the device: no step reads a tensor's value on the
    host; on CUDA the only synchronising calls are the beats' reads of finished intervals' numbers."""
    import warnings

    syncs = []
    # the CPU case on a GPU machine too: `auto` would pick the GPU there
    with ddplab.init(DistConfig(backend="gloo" if device == "cpu" else "auto")) as rt:
        assert rt.device.type == device
        exp = Counted(config(tmp_path, "trainer.log_every=5", "hidden=64", "trainer.max_steps=20"))
        step = exp.trainer.train_step
        reads = HostReads()

        def watched(batches):
            with warnings.catch_warnings(record=True) as caught, reads:
                warnings.simplefilter("always")
                if device == "cuda":
                    torch.cuda.set_sync_debug_mode("warn")
                try:
                    return step(batches)
                finally:
                    if device == "cuda":
                        torch.cuda.set_sync_debug_mode(0)
                    # not torch's own "debug mode is a prototype" notice, which also says "synchronizing"
                    syncs.extend(w for w in caught if "called a synchronizing" in str(w.message))

        monkeypatch.setattr(exp.trainer, "train_step", watched)
        exp.fit()
    assert exp.step == 20 and len(logged(exp, "train/")) == 4
    assert reads.where == []
    if device == "cuda":
        # the beats (about once a second, so at most one per interval): the read of their numbers
        assert 1 <= len(syncs) <= 4 and all(
            w.filename.endswith(os.path.join("train", "intervals.py")) for w in syncs
        ), [(w.filename, w.lineno, str(w.message)) for w in syncs]
