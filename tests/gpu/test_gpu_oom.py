"""trainer.oom_backoff with a real CUDA out-of-memory: a network 2^20 units wide (about 8 MB of
activations per sample) under a 400 MB cap on what torch may allocate, and micro-batches of 64.
The run must halve its micro-batches until they fit, finish, and train what a run with that
micro-batch from the start trains. Needs a GPU (`make test-gpu`); the CPU half is test_oom_backoff.py."""

import re

import pytest
import torch

from helpers import ddplab

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.slow,
    pytest.mark.timeout(600),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: `make test-gpu`"),
]
EXP = "tests/fixtures/elastic.py:MemoryBound"
COMMON = [
    "trainer.max_steps=6",
    "trainer.global_batch_size=64",
    "trainer.eval_batch_size=2",
    "trainer.progress=false",
    "log.tensorboard=false",
    "model.hidden=1048576",
    "fault.cuda_memory_mb=400",
]


def _params(tmp_path, name):
    return torch.load(tmp_path / "memorybound" / name / "results" / "params-rank0.pt", weights_only=True)


def test_a_micro_batch_that_does_not_fit_the_gpu_is_halved_until_it_does(tmp_path):
    # in processes of their own: the memory limit and CUDA's state are a process's
    res = ddplab("run", EXP, f"run.dir={tmp_path}", "run.name=b", *COMMON, "trainer.oom_backoff=true", timeout=500)
    out = res.stdout
    assert res.returncode == 0, out + res.stderr
    pieces = [int(n) for n in re.findall(r"every rank redoes the step with (\d+)", out)]
    assert pieces and pieces == sorted(pieces, reverse=True), out
    settings = [f"trainer.micro_batch_size={pieces[-1]}", "trainer.accumulate=auto"]
    res = ddplab("run", EXP, f"run.dir={tmp_path}", "run.name=s", *COMMON, *settings, timeout=500)
    assert res.returncode == 0, res.stdout + res.stderr
    a, b = _params(tmp_path, "b"), _params(tmp_path, "s")
    assert all(torch.allclose(a[k], b[k], rtol=1e-5, atol=1e-6) for k in a)
