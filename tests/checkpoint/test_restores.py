"""Every piece of state a checkpoint holds is proven restored: for each entry of the state mapping
(train/checkpointed.py) and each random stream, a run resumed from a mid-epoch checkpoint with that
one left unrestored must differ from the straight run, while the run resumed with everything
restored ends bit for bit where the straight run ends. The experiment (fixtures/restores.py) draws
from numpy, Python's random and torch, keeps state of its own, averages its weights (EMA) and stops
early, so that each entry shows in what it trains. One process: what is checked is the mapping's
entries, and that each rank continues its own random streams is test_checkpoints' (2-rank resumes
with dropout)."""

import pytest
import torch
from safetensors.torch import load_file

from helpers import cuda_case, metrics_rows, run_target

pytestmark = [pytest.mark.slow, pytest.mark.timeout(200)]

TARGET = "tests/fixtures/restores.py:Restores"
SETTINGS = [
    "trainer.progress=false", "log.tensorboard=false", "trainer.global_batch_size=32", "model.dropout=0.2",
    "trainer.ema_decay=0.9", "trainer.max_steps=40", "trainer.eval_every=4", "trainer.checkpoint_every=8",
    "checkpoint.keep_last=0", "trainer.early_stop.monitor=loss", "trainer.early_stop.min_delta=100",
    "trainer.early_stop.patience=4", "trainer.log_every=1",
]  # fmt: skip
# 16 steps an epoch: the checkpoint at step 8 is mid-epoch, the one at step 16 ends the first epoch
# (the most common kind); the straight run stops early at step 20
MID_EPOCH, EPOCH_END = "step-00000008", "step-00000016"
METADATA = {"world_size", "loggers", "kinds", "config", "format", "versions"}
# each entry of the state mapping with this experiment's settings, and each random stream a CPU run
# keeps; an entry the mapping gains fails test_the_cases_are_every_entry_of_the_checkpoint until
# it has a case here (or a reason in UNSEEN)
ENTRIES = [
    "models", "ema", "optimizers", "schedulers", "progress", "early_stop",
    "experiment.counter", "rng.python", "rng.numpy", "rng.torch",
]  # fmt: skip
# entries whose loss this experiment cannot show, and why (each is tested elsewhere)
UNSEEN = {
    "scaler": "fp16's grad scaler: no fp16 on the CPU (test_gpu: fp16 resumes bit for bit)",
    "comm_hooks": "PowerSGD's state, without dist.comm_hook here (test_scaling: PowerSGD resumes bitwise)",
    "eval_metrics": "the last evaluation, read only to skip a repeated evaluation at the end",
    "sampler": "not state but a check: the seed and global batch the order was drawn with must be the same "
    "(test_checkpoints::test_resume_with_another_global_batch_*); where the order stands is progress's",
    "data": "a stream's position; a Dataset's position is the progress (test_data_sources: streams resume)",
}


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    root = tmp_path_factory.mktemp("restores")
    run_target(TARGET, root, "straight", *SETTINGS, n=1)
    return root


def _final(root, name):
    (weights,) = (root / "restores" / name / "final").glob("*.safetensors")
    return load_file(weights)


def _losses(root, name, after):
    """Each step's training loss after step `after` (one line a step)."""
    rows = metrics_rows(root / "restores" / name)
    return [(row["step"], row["train/loss"]) for row in rows if "train/loss" in row and row["step"] > after]


def _resume(root, name, checkpoint, *args):
    path = root / "restores" / "straight" / "checkpoints" / checkpoint
    return run_target(TARGET, root, name, *SETTINGS, f"run.resume={path}", *args, n=1)


def _same(root, name, checkpoint):
    """The resumed run trained the straight run's steps: the same losses, the same final weights."""
    after = int(checkpoint.split("-")[1])
    straight, resumed = _final(root, "straight"), _final(root, name)
    weights = all(torch.equal(straight[k], resumed[k]) for k in straight)
    return weights and _losses(root, "straight", after) == _losses(root, name, after)


def test_the_cases_are_every_entry_of_the_checkpoint(straight):
    path = straight / "restores" / "straight" / "checkpoints" / MID_EPOCH / "state.pt"
    saved = torch.load(path, weights_only=True)
    streams = {e for e in ENTRIES if e.startswith("rng.")}
    assert set(saved) - METADATA == (set(ENTRIES) - streams) | {"rng"} | set(UNSEEN)
    assert {f"rng.{name}" for name in saved["rng"][0]} == streams


@pytest.mark.parametrize("checkpoint", [MID_EPOCH, EPOCH_END])
def test_a_run_resumed_with_everything_restored_ends_where_the_straight_run_ends(straight, checkpoint):
    _resume(straight, f"restored-{checkpoint}", checkpoint)
    assert _same(straight, f"restored-{checkpoint}", checkpoint)


CASES = [(entry, MID_EPOCH) for entry in ENTRIES] + [("progress", EPOCH_END)]


@pytest.mark.parametrize("entry,checkpoint", CASES)
def test_a_run_resumed_without_one_entry_differs(straight, entry, checkpoint):
    name = f"without-{entry}-{checkpoint}"
    _resume(straight, name, checkpoint, f"fault.skip_restore={entry}")
    assert not _same(straight, name, checkpoint)


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    "device",
    [
        "cpu",
        cuda_case(),
    ],
)
def test_every_random_stream_comes_back_from_a_checkpoint_loaded_onto_the_run_device(tmp_path, device):
    """A resumed run loads its checkpoint onto its own device (map_location), RNG states included, but
    torch sets a generator, CUDA's too, only from a CPU ByteTensor: on a GPU every resume stopped at
    its first line until `seeding.restore` brought them back."""
    import random

    import numpy as np

    from ddplab import seeding

    torch.zeros(1, device=device)  # CUDA's state is captured once CUDA is in use
    seeding.seed_everything(3)
    torch.save(seeding.capture(), tmp_path / "rng.pt")
    drawn = [random.random(), np.random.rand(), torch.rand(1).item(), torch.rand(1, device=device).item()]
    seeding.restore(torch.load(tmp_path / "rng.pt", map_location=device, weights_only=True))
    again = [random.random(), np.random.rand(), torch.rand(1).item(), torch.rand(1, device=device).item()]
    assert again == drawn
