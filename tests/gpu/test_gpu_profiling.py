"""Seeing inside a run on a GPU (`make test-gpu`; skipped without CUDA): the forward timed with CUDA
events for the slow-rank check, and trainer.profile's CUDA kernels and memory snapshot. Their CPU
halves are test_stragglers.py and test_profiling.py."""

import json
import pickle

import pytest
import torch

from ddplab.train.stragglers import ForwardClock
from helpers import run_target

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.slow,
    pytest.mark.timeout(300),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: `make test-gpu` on a GPU machine"),
]


def test_the_forward_clock_times_the_device_and_never_waits_for_it():
    device = torch.device("cuda")
    clock = ForwardClock(device)
    x = torch.randn(2048, 2048, device=device)
    clock.start()
    for _ in range(20):
        x = x @ x / 2048
    clock.stop()
    torch.cuda.synchronize()
    measured = clock.take()
    # the device's time, not the host's few microseconds of launching
    assert measured > 1e-4
    # nothing is left pending once taken, and a second take starts from zero
    assert clock.take() == 0.0


def test_a_profile_on_the_gpu_records_kernels_and_a_memory_snapshot(tmp_path):
    res = run_target(
        "tests/fixtures/experiments.py:Classifier", tmp_path, "r", "trainer.progress=false",
        "log.tensorboard=false", "trainer.max_steps=20", "trainer.profile=5:10", n=1,
    )  # fmt: skip
    folder = tmp_path / "classifier" / "r" / "profile"
    events = json.loads((folder / "trace_rank0.json").read_text())["traceEvents"]
    assert any(e.get("cat") == "kernel" for e in events)
    with open(folder / "memory_rank0.pickle", "rb") as f:
        snapshot = pickle.load(f)
    assert snapshot["segments"]
    assert "the GPU computes" in res.stdout
