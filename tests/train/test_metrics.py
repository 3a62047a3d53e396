"""Training metrics: true weighted means over steps and ranks, whatever the log interval, and the
non-finite loss check. One process for the accumulation rules, two real gloo ranks for the logs."""

import pytest
import torch

from ddplab.errors import ConfigError
from ddplab.train.metrics import FOLD, MetricTracker, means, pack_intervals
from ddplab.train.nonfinite import NonFiniteGuard
from helpers import ddplab_here, metrics_rows

CPU = torch.device("cpu")


def test_weighted_means_of_numbers_and_tensors_past_the_fold():
    tracker = MetricTracker(CPU)
    # values are summed in chunks of FOLD: the total must not depend on that
    n = 2 * FOLD + 17
    for i in range(n):
        tracker.add("plain", float(i))
        tracker.add("mixed", torch.tensor(float(i)) if i % 2 else float(i), weight=float(i % 3))
        tracker.add("tensor_weight", torch.tensor([i, i + 2.0]), weight=torch.tensor(2.0 if i < 10 else 1.0))
    got = tracker.compute()
    weights = [i % 3 for i in range(n)]
    assert got["plain"] == pytest.approx((n - 1) / 2)
    assert got["mixed"] == pytest.approx(sum(i * w for i, w in enumerate(weights)) / sum(weights))
    tw = [2.0 if i < 10 else 1.0 for i in range(n)]
    assert got["tensor_weight"] == pytest.approx(sum((i + 1) * w for i, w in enumerate(tw)) / sum(tw))
    # computing starts afresh
    assert tracker.compute() == {}


def test_intervals_packed_together_keep_their_own_names_and_means():
    tracker, taken = MetricTracker(CPU), []
    for i in range(FOLD + 3):
        # the first interval folds once on the way
        tracker.add("loss", torch.tensor(float(i)))
        # an int64 tensor among float32 ones
        tracker.add("count", torch.tensor(i % 2), weight=2.0)
    taken.append(tracker.take())
    tracker.add("accuracy", torch.tensor(0.25, dtype=torch.float64), weight=torch.tensor(3.0))
    tracker.add("accuracy", 0.75)
    taken.append(tracker.take())
    # an interval that logged nothing
    taken.append(tracker.take())
    names, packed = pack_intervals(taken, CPU)
    assert names == [["count", "loss"], ["accuracy"], []]
    n = FOLD + 3
    assert means(names[0], packed[:4].tolist()) == pytest.approx({"count": (n // 2) / n, "loss": (n - 1) / 2})
    assert means(names[1], packed[4:].tolist()) == pytest.approx({"accuracy": (0.25 * 3 + 0.75) / 4})
    assert packed.numel() == 6


def test_a_logged_buffer_is_copied_when_logged():
    tracker, counter = MetricTracker(CPU), torch.zeros(())
    for _ in range(3):
        counter += 1
        # the value now, not the buffer's value at log time
        tracker.add("counter", counter)
    assert tracker.compute()["counter"] == pytest.approx(2.0)


@pytest.mark.parametrize("per_step", [1, 3])
@pytest.mark.parametrize("bad_step", [3, FOLD + 14])
def test_nonfinite_guard_names_the_first_bad_step(bad_step, per_step):
    guard = NonFiniteGuard("error", CPU, rank=0, world_size=1)
    for first in range(1, FOLD + 40, 10):
        # handed over ten steps at a time, as at each log line
        losses = []
        for step in range(first, first + 10):
            for micro in range(per_step):
                loss = torch.tensor(1.0, requires_grad=True) * 2
                if step == bad_step and micro == per_step - 1:
                    # the step's last micro-batch only
                    loss = loss * float("nan")
                elif step == bad_step + 5:
                    loss = loss * float("inf")
                losses.append(loss.detach())
        guard.watch(losses, first, per_step)
    assert guard.flag().item() == 1.0
    with pytest.raises(ConfigError, match=rf"at step {bad_step} on rank 0"):
        guard.check()


def test_a_finite_run_passes_the_guard():
    guard = NonFiniteGuard("error", CPU, rank=0, world_size=1)
    for first in range(1, 2 * FOLD, 7):
        guard.watch([torch.tensor(0.5)] * 7, first, 1)
    assert guard.flag().item() == 0.0
    guard.check()


def test_the_guard_reads_one_element_losses_of_either_shape_and_stays_bounded():
    """Losses of shape () and (1,) mixed (models return either); rank 2 of 3 codes its steps. The
    mode is built at run time, as when it comes from a config file, not an interned literal."""
    guard = NonFiniteGuard("".join(["er", "ror"]), CPU, rank=2, world_size=3)
    losses = [torch.tensor(1.0) if i % 2 else torch.tensor([1.0]) for i in range(FOLD + 1)]
    # step 250 (1-based): code 250 * 3 + 2
    losses[FOLD - 7] = torch.tensor([float("nan")])
    guard.watch(losses, 1, 1)
    # folded at once, however many came: memory stays bounded
    assert len(guard._losses) < FOLD
    assert guard.flag().item() == 1.0
    with pytest.raises(ConfigError, match=rf"at step {FOLD - 6} on rank 2"):
        guard.check()


def test_skip_mode_keeps_no_losses_and_never_stops_the_run():
    guard = NonFiniteGuard("".join(["sk", "ip"]), CPU, rank=0, world_size=1)
    guard.watch([torch.tensor(float("nan"))] * 3, 1, 1)
    assert guard.flag() is None and not guard._losses
    # no error: skip mode handles bad steps by skipping them
    guard.check()


def test_gradients_finite_looks_at_every_gradient_and_only_at_gradients():
    guard = NonFiniteGuard("skip", CPU, rank=0, world_size=1)
    a, b = torch.nn.Linear(2, 1), torch.nn.Linear(2, 1)
    # no gradient yet: nothing to refuse
    assert guard.gradients_finite([a, b])
    a(torch.ones(1, 2)).sum().backward()
    # b has no gradient: it is left out, not counted as bad
    assert guard.gradients_finite([a, b])
    b(torch.ones(1, 2)).sum().backward()
    b.bias.grad[0] = float("inf")
    assert not guard.gradients_finite([a, b])


def test_losses_added_all_at_once_average_like_one_by_one():
    one_by_one, at_once = MetricTracker(CPU), MetricTracker(CPU)
    losses = [torch.tensor(float(i)) if i % 2 else torch.tensor([float(i)]) for i in range(FOLD + 9)]
    for loss in losses:
        one_by_one.add("loss", loss)
    at_once.add_all("loss", losses[:100])
    at_once.add_all("loss", losses[100:])
    assert at_once.compute() == pytest.approx(one_by_one.compute()) == {"loss": (FOLD + 8) / 2}


def _expected(first: int, last: int, world: int = 2) -> float:
    """The true mean of what KnownMetrics logs over steps first..last on every rank."""
    pairs = [(1000 * r + s, r + 1) for r in range(world) for s in range(first, last + 1)]
    return sum(v * w for v, w in pairs) / sum(w for _, w in pairs)


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("log_every", [7, 300])
def test_logged_lines_are_true_means_over_their_interval_and_both_ranks(tmp_path, log_every):
    steps = 300
    res = ddplab_here(
        "run",
        "tests/fixtures/experiments.py:KnownMetrics",
        "-n",
        "2",
        f"run.dir={tmp_path}",
        "run.name=m",
        f"trainer.max_steps={steps}",
        f"trainer.log_every={log_every}",
        "trainer.global_batch_size=8",
        "trainer.progress=false",
        "log.tensorboard=false",
        "checkpoint.at_end=false",
    )
    assert res.returncode == 0, res.stdout + res.stderr
    rows = metrics_rows(tmp_path / "knownmetrics" / "m")
    train = [r for r in rows if "train/known" in r]
    ends = list(range(log_every, steps + 1, log_every))
    ends += [steps] if ends[-1] != steps else []
    # every interval, once, in order
    assert [r["step"] for r in train] == ends
    for start, row in zip([0, *ends], train, strict=False):
        want = _expected(start + 1, row["step"])
        assert row["train/known"] == pytest.approx(want, rel=1e-12)
        assert row["train/known_t"] == pytest.approx(want, rel=1e-6)
    times = [r["time"] for r in train]
    assert times == sorted(times)
    # and on the console
    assert sum(f"train step {s} " in res.stdout for s in ends) == len(ends)


def test_intervals_of_three_metrics_each_keep_their_slots():
    """Slot offsets of odd sizes (3 names: 6 slots an interval), where `a + b` and `a | b` differ."""
    tracker, taken, expected = MetricTracker(CPU), [], []
    for interval in range(3):
        values = {"a": [1.0 + interval, 2.0], "b": [10.0 * (interval + 1)], "c": [interval - 5.0, 3.0, 4.0]}
        for name, vs in values.items():
            for v in vs:
                tracker.add(name, torch.tensor(v))
        taken.append(tracker.take())
        expected.append({n: sum(vs) / len(vs) for n, vs in values.items()})
    names, packed = pack_intervals(taken, CPU)
    for i, want in enumerate(expected):
        assert means(names[i], packed[6 * i : 6 * i + 6].tolist()) == pytest.approx(want)
    # nothing logged: NaN
    assert means(["x"], [0.0, 0.0]) == {"x": pytest.approx(float("nan"), nan_ok=True)}
    # a mean of 0 is a number
    assert means(["x", "y"], [0.0, 6.0, 2.0, 3.0]) == {"x": 0.0, "y": 2.0}


def test_losses_added_at_once_mix_with_weighted_values_by_their_weights():
    tracker = MetricTracker(CPU)
    # weight 1 each
    tracker.add_all("loss", [torch.tensor(1.0), torch.tensor(2.0)])
    tracker.add("loss", torch.tensor(4.0), weight=3.0)
    assert tracker.compute() == pytest.approx({"loss": (1 + 2 + 3 * 4) / 5})


def test_kept_values_stay_below_the_fold_however_they_come():
    tracker, most = MetricTracker(CPU), 0
    for _ in range(3 * FOLD):
        tracker.add("one", torch.tensor(1.0))
        tracker.add_all("seven", [torch.tensor(2.0)] * 7)
        most = max(most, *(len(s.values) for s in tracker._series.values()))
    assert most < FOLD
    assert tracker.compute() == pytest.approx({"one": 1.0, "seven": 2.0})


@pytest.mark.slow
@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "fault, shown",
    [
        ("fault.log_on_rank1=extra", "rank 0 ['acc'], rank 1 ['acc', 'extra']"),
        ("fault.log_named_by_rank=true", "rank 0 ['acc', 'by_rank0'], rank 1 ['acc', 'by_rank1']"),
    ],
)
def test_metric_names_that_differ_between_ranks_are_refused_in_one_line(tmp_path, fault, shown):
    """Summed slot by slot, names that differ would merge into each other (same count) or misalign
    the packed sums (one rank's extra metric, which gloo ended in a thread dump)."""
    res = ddplab_here(
        "run",
        "tests/fixtures/experiments.py:Classifier",
        "-n",
        "2",
        f"run.dir={tmp_path}",
        "trainer.progress=false",
        "log.tensorboard=false",
        "trainer.global_batch_size=32",
        "trainer.max_steps=6",
        "trainer.log_every=2",
        fault,
    )
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert res.returncode == 2 and len(lines) == 1, res.stdout + res.stderr
    assert "the ranks logged different metrics in the log interval(s) up to step" in lines[0]
    assert shown in lines[0]
