"""The slow rank named (train/stragglers.py): real ranks over gloo, one of them slowed down on purpose
in its dataset's __getitem__ or in its training_step, and the line that names it, the per-rank
records in metrics.jsonl and summary.json; ranks that are alike name nobody. The rule itself
(persistence, catching up, the floor) on figures given by hand."""

import json

import pytest

from ddplab.train.stragglers import PERSIST_BEATS, StragglerWatch, per_rank_means
from helpers import run_target

TARGET = "tests/fixtures/experiments.py:Classifier"
COMMON = ["trainer.progress=false", "log.tensorboard=false", "trainer.max_steps=150"]


def _run(tmp_path, n, *args):
    res = run_target(TARGET, tmp_path, "r", *COMMON, f"trainer.global_batch_size={16 * n}", *args, n=n, timeout=150)
    run = tmp_path / "classifier" / "r"
    named = [line for line in res.stdout.splitlines() if "is slow and every rank waits for it" in line]
    return res.stdout, named, json.loads((run / "summary.json").read_text())


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
