"""Whatever ranks checkpoints or runs by a monitored metric, in both directions. The evaluations below
have one best under max and another under min, and a NaN among them: a consumer that ignores the
mode, reads it backwards, or lets a NaN win, picks another step. (Sweeps: test_sweep_listing, both
modes.)"""

import json
import math

import pytest
from omegaconf import OmegaConf

from ddplab.checkpoint.store import CheckpointManager
from ddplab.config import EarlyStopConfig
from ddplab.tools.listing import print_checkpoints
from ddplab.train.early_stop import EarlyStop
from ddplab.train.summary import load_run, record

# (step, eval/auc): max is step 6, min is step 8; the NaN of step 2 is neither (first, where a plain
# max() or min() keeps it: no value compares greater or smaller than NaN)
EVALUATIONS = [(2, math.nan), (4, 0.5), (6, 0.9), (8, 0.2), (10, 0.6)]
BEST = {"max": 6, "min": 8}
MODES = pytest.mark.parametrize("mode", ["max", "min"])


def _run_folder(tmp_path, mode: str):
    """A run folder as training leaves it: config.yaml, metrics.jsonl, every checkpoint kept."""
    OmegaConf.save(OmegaConf.create({"checkpoint": {"monitor": "auc", "mode": mode}}), tmp_path / "config.yaml")
    with open(tmp_path / "metrics.jsonl", "w") as f:
        for step, auc in EVALUATIONS:
            f.write(json.dumps({"step": step, "train/loss": 1.0 / step}) + "\n")
            f.write(json.dumps({"step": step, "eval/auc": auc}) + "\n")
    manager = CheckpointManager(str(tmp_path / "checkpoints"), keep_last=0, monitor="auc", mode=mode)
    for step, auc in EVALUATIONS:
        manager.save({"w": [step]}, step, 0, auc)
    return tmp_path


@MODES
def test_the_best_checkpoints_kept_follow_the_mode(tmp_path, mode):
    manager = CheckpointManager(str(tmp_path), keep_last=1, keep_best=1, monitor="auc", mode=mode)
    for step, auc in EVALUATIONS:
        manager.save({"w": [step]}, step, 0, auc)
    assert [c.step for c in manager.best()] == [BEST[mode]]
    assert [c.step for c in manager.list()] == sorted({BEST[mode], 10})


@MODES
def test_ddplab_checkpoints_marks_the_best_of_the_runs_mode(tmp_path, mode, capsys):
    print_checkpoints(str(_run_folder(tmp_path, mode)))
    marked = [line.split()[1] for line in capsys.readouterr().out.splitlines() if "best" in line.split()[-2:]]
    assert marked == [str(BEST[mode])]


@MODES
def test_a_runs_summary_and_ddplab_runs_name_the_best_of_its_mode(tmp_path, mode):
    best = record(load_run(str(_run_folder(tmp_path, mode))))["best"]
    assert best == {"metric": "auc", "mode": mode, "value": dict(EVALUATIONS)[BEST[mode]], "step": BEST[mode]}


@MODES
def test_early_stopping_counts_from_the_best_of_its_mode(mode):
    stop = EarlyStop(EarlyStopConfig(monitor="auc", mode=mode, patience=3))
    for step, auc in EVALUATIONS:
        stop.after_evaluation({"auc": auc}, step)
    # after the best, the evaluations that did not improve on it
    after = [s for s, _ in EVALUATIONS if s > BEST[mode]]
    assert (stop.best_step, stop.bad) == (BEST[mode], len(after))
