"""The slow rank named (train/stragglers.py): real ranks over gloo, one of them slowed down on purpose
in its dataset's __getitem__ or in its training_step, and the line that names it, the per-rank
records in metrics.jsonl and summary.json; ranks that are alike name nobody. The rule itself
(persistence, catching up, the floor) on figures given by hand."""

import json

import pytest
import torch

from ddplab.train.stragglers import (
    PERSIST_BEATS,
    ForwardClock,
    StragglerWatch,
    describe,
    per_rank_line,
    per_rank_means,
    slowest_rank,
)
from helpers import run_target, summary_of

TARGET = "tests/fixtures/experiments.py:Classifier"
COMMON = ["trainer.progress=false", "log.tensorboard=false", "trainer.max_steps=150"]


def _run(tmp_path, n, *args):
    res = run_target(TARGET, tmp_path, "r", *COMMON, f"trainer.global_batch_size={16 * n}", *args, n=n)
    run = tmp_path / "classifier" / "r"
    named = [line for line in res.stdout.splitlines() if "is slow and every rank waits for it" in line]
    return res.stdout, named, summary_of(run)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_rank_whose_dataset_is_slow_is_named_as_waiting_for_data(tmp_path):
    # 3 ms per sample, 16 samples a step: about 50 ms a step on rank 1 alone
    out, named, summary = _run(tmp_path, 2, "fault.slow_rank=1", "fault.slow_in=data", "fault.slow_s=0.003")
    assert len(named) == 1, named
    assert "rank 1 (" in named[0] and "it waits for data" in named[0]
    ranks = summary["ranks"]
    assert ranks["data_s"][1] > 0.03 > ranks["data_s"][0]
    assert "ms per step waiting for data/in the forward, by rank: 0: " in out
    metrics = (tmp_path / "classifier" / "r" / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line)["ranks"] for line in metrics if '"ranks"' in line]
    # every step of the run is in a record, each with both ranks' figures
    assert sum(r["steps"] for r in records) == 150
    assert all(len(r["step_s"]) == len(r["data_s"]) == len(r["forward_s"]) == 2 for r in records)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_rank_slow_in_training_step_is_named_as_slow_to_compute(tmp_path):
    _, named, summary = _run(tmp_path, 3, "fault.slow_rank=2", "fault.slow_in=forward", "fault.slow_s=0.04")
    assert len(named) == 1, named
    assert "rank 2 (" in named[0] and "it computes its forward in" in named[0]
    forward = summary["ranks"]["forward_s"]
    assert forward[2] > 0.035 and max(forward[:2]) < 0.02


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_ranks_that_are_alike_name_nobody(tmp_path):
    _, named, summary = _run(tmp_path, 3, "trainer.max_steps=400")
    assert named == []
    assert len(summary["ranks"]["forward_s"]) == 3


def _watch():
    said, records = [], []
    watch = StragglerWatch(3, said.append, lambda step, figures: records.append((step, figures)), ["a", "b", "c"])
    return watch, said, records


# (step, data wait, forward) in seconds per step for each of three ranks
ALIKE = [[0.05, 0.001, 0.01]] * 3
RANK2_DATA = [[0.05, 0.001, 0.01], [0.05, 0.001, 0.01], [0.05, 0.03, 0.01]]


def test_a_rank_is_named_after_persisting_and_said_to_catch_up_after_as_long():
    watch, said, _ = _watch()
    for beat in range(PERSIST_BEATS - 1):
        watch.observe(beat, RANK2_DATA, 10)
    assert said == []
    watch.observe(PERSIST_BEATS, RANK2_DATA, 10)
    assert len(said) == 1 and "rank 2" in said[0] and "waits for data 30 ms" in said[0]
    # slow again: not named twice
    for beat in range(10):
        watch.observe(beat, RANK2_DATA, 10)
    assert len(said) == 1
    for beat in range(PERSIST_BEATS):
        watch.observe(beat, ALIKE, 10)
    assert len(said) == 2 and "rank 2" in said[1] and "caught up" in said[1]


def test_a_slow_beat_between_normal_ones_names_nobody():
    watch, said, _ = _watch()
    for beat in range(4 * PERSIST_BEATS):
        watch.observe(beat, RANK2_DATA if beat % 2 else ALIKE, 10)
    assert said == []


def test_a_lag_below_the_floor_or_the_share_names_nobody():
    watch, said, _ = _watch()
    # 1 ms more than the others: above 20 % of a 4 ms step, below the 2 ms floor
    tiny = [[0.004, 0.0, 0.001], [0.004, 0.0, 0.001], [0.004, 0.001, 0.001]]
    # 5 ms more on a 100 ms step
    small = [[0.1, 0.0, 0.05], [0.1, 0.0, 0.05], [0.1, 0.005, 0.05]]
    for beat in range(3 * PERSIST_BEATS):
        watch.observe(beat, tiny if beat < 2 * PERSIST_BEATS else small, 10)
    assert said == []


def test_records_are_means_weighted_by_steps():
    watch, _, records = _watch()
    watch.observe(1, ALIKE, 30)
    watch.observe(2, RANK2_DATA, 10)
    watch.flush(2)
    ((step, figures),) = records
    assert step == 2 and figures["steps"] == 40
    assert figures["data_s"][2] == pytest.approx((0.001 * 30 + 0.03 * 10) / 40)
    assert per_rank_means([{"step": 2, "ranks": figures}])["data_s"] == figures["data_s"]


RANK1_FORWARD = [[0.06, 0.02, 0.01], [0.06, 0.025, 0.045], [0.06, 0.02, 0.012]]


def test_the_named_line_says_host_step_and_cause_with_the_median_rank_beside_it():
    assert describe(2, "node-c", RANK2_DATA, 40) == (
        "step 40: rank 2 (node-c) is slow and every rank waits for it (steps of 50 ms): it waits for data 30 ms "
        "per step, the median rank 1 ms: look at its data loading (trainer.num_workers, its disk, its CPU)"
    )
    assert describe(1, "node-b", RANK1_FORWARD, 7) == (
        "step 7: rank 1 (node-b) is slow and every rank waits for it (steps of 60 ms): it computes its forward "
        "in 45 ms per step, the median rank 12 ms: look at its device (a slower or throttled GPU or CPU, other "
        "jobs on it) or at uneven work (longer samples on this rank)"
    )
    assert slowest_rank(RANK1_FORWARD) == (1, pytest.approx(0.07 - 0.032), 0.06)
    # figures of seconds: the milliseconds shown are exact to the unit
    slow_disk = [[0.95, 0.3, 0.01], [0.95, 0.7, 0.01], [0.95, 0.9, 0.01]]
    assert "(steps of 950 ms): it waits for data 900 ms per step, the median rank 700 ms" in describe(
        2, "c", slow_disk, 1
    )
    # what a rank does longer than the median rank decides, not the sizes of the figures themselves
    slow_disk_fast_device = [[0.95, 0.0, 0.4], [0.95, 0.0, 0.4], [0.95, 0.05, 0.4]]
    assert "it waits for data 50 ms" in describe(2, "c", slow_disk_fast_device, 1)
    slow_device_busy_disk = [[0.95, 0.4, 0.0], [0.95, 0.4, 0.0], [0.95, 0.4, 0.05]]
    assert "it computes its forward in 50 ms" in describe(2, "c", slow_device_busy_disk, 1)
    slow_device = [[0.95, 0.0, 0.3], [0.95, 0.0, 0.7], [0.95, 0.0, 0.9]]
    assert "it computes its forward in 900 ms per step, the median rank 700 ms" in describe(2, "c", slow_device, 1)


def test_a_rank_that_stays_named_is_said_to_catch_up_only_after_as_many_beats_in_a_row():
    watch, said, _ = _watch()
    for beat in range(PERSIST_BEATS):
        watch.observe(beat, RANK2_DATA, 10)
    # normal beats interrupted by a slow one start counting again
    for beat in range(2 * PERSIST_BEATS - 1):
        watch.observe(beat, RANK2_DATA if beat == PERSIST_BEATS - 1 else ALIKE, 10)
    assert len(said) == 1
    watch.observe(99, ALIKE, 10)
    assert said[1] == "step 99: rank 2 (c) has caught up with the others"
    assert watch.named is None


def test_the_summary_line_shows_each_rank_or_for_many_the_median_and_the_slowest():
    means = {"data_s": [0.0004, 0.5, 0.0005], "forward_s": [0.011, 0.0102, 0.7]}
    assert per_rank_line(means) == (
        "  ms per step waiting for data/in the forward, by rank: 0: 0.4/11.0, 1: 500.0/10.2, 2: 0.5/700.0"
    )
    eight = {"data_s": [0.002] * 8, "forward_s": [0.01] * 8}
    assert per_rank_line(eight).endswith("by rank: " + ", ".join(f"{rank}: 2.0/10.0" for rank in range(8)))
    # rank 5 is the slowest by its sum; rank 8 would be by a product
    many = {"data_s": [0.2] * 5 + [0.07] + [0.2] * 2 + [0.3], "forward_s": [0.4] * 5 + [0.9] + [0.4] * 2 + [0.3]}
    assert per_rank_line(many) == (
        "  ms per step waiting for data/in the forward, by rank: median 200.0/400.0, slowest rank 5: 70.0/900.0"
    )


def test_a_runs_means_weigh_each_record_by_its_steps_over_its_last_world_size():
    def record(world, data, steps):
        return {
            "step": 1,
            "ranks": {"step_s": [0.1] * world, "data_s": data, "forward_s": [0.01] * world, "steps": steps},
        }

    rows = [record(2, [0.1, 0.3], 10), record(3, [0.5, 0.5, 0.5], 100), {"step": 2}, record(2, [0.2, 0.0], 30)]
    means = per_rank_means(rows)
    assert means["data_s"] == pytest.approx([(0.1 * 10 + 0.2 * 30) / 40, (0.3 * 10) / 40])
    assert means["forward_s"] == pytest.approx([0.01, 0.01]) and means["step_s"] == pytest.approx([0.1, 0.1])
    assert per_rank_means([{"step": 1}]) is None


def test_records_come_every_ten_seconds_and_a_flush_with_nothing_new_writes_nothing(monkeypatch):
    clock = [1000.0]
    monkeypatch.setattr("ddplab.train.stragglers.time.monotonic", lambda: clock[0])
    watch, _, records = _watch()
    watch.observe(1, ALIKE, 5)
    clock[0] += 9.9
    watch.observe(2, ALIKE, 5)
    assert records == []
    clock[0] += 0.2
    watch.observe(3, ALIKE, 5)
    assert [(step, r["steps"]) for step, r in records] == [(3, 15)]
    watch.flush(3)
    assert len(records) == 1
    clock[0] += 10.5
    watch.observe(4, RANK2_DATA, 2)
    assert [(step, r["steps"]) for step, r in records] == [(3, 15), (4, 2)]
    # each record is of its own steps only
    assert records[1][1]["data_s"] == pytest.approx([0.001, 0.001, 0.03])


def test_the_cpu_clock_adds_each_forward_and_starts_again_at_each_take(monkeypatch):
    readings = iter([1.0, 3.5, 4.0, 4.25, 5.0])
    monkeypatch.setattr("ddplab.train.stragglers.time.perf_counter", lambda: next(readings))
    clock = ForwardClock(torch.device("cpu"))
    clock.start()
    clock.stop()
    clock.start()
    clock.stop()
    assert clock.take() == pytest.approx(2.75) and clock.take() == 0.0
    # a forward that raised: its start is dropped by the next one
    clock.start()
    assert clock.take() == 0.0 and not clock.cuda


def test_ranks_slow_in_turn_are_never_one_persisting_straggler():
    watch, said, _ = _watch()
    rank1_data = [[0.05, 0.001, 0.01], [0.05, 0.03, 0.01], [0.05, 0.001, 0.01]]
    for beat in range(4 * PERSIST_BEATS):
        watch.observe(beat, RANK2_DATA if beat % 4 < 2 else rank1_data, 10)
    assert said == []


def test_a_run_that_grew_is_averaged_over_its_last_size_only():
    def record(world, data, steps):
        return {
            "step": 1,
            "ranks": {"step_s": [0.1] * world, "data_s": data, "forward_s": [0.01] * world, "steps": steps},
        }

    means = per_rank_means([record(2, [0.1, 0.3], 10), record(3, [0.2, 0.0, 0.4], 30)])
    assert means["data_s"] == pytest.approx([0.2, 0.0, 0.4])
