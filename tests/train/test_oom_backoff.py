"""trainer.oom_backoff on the CPU: the test experiment's last rank raises torch.OutOfMemoryError (as
CUDA does) on micro-batches above fault.oom_above samples, so the mechanism runs without a GPU: every
rank redoes the step with smaller micro-batches, the global batch stays, and the result is the run
that used those micro-batches from the start."""

import pytest
import torch

from helpers import run_target

pytestmark = pytest.mark.timeout(60)
EXP = "tests/fixtures/elastic.py:MemoryBound"
COMMON = [
    "trainer.max_steps=20",
    "trainer.global_batch_size=16",
    "trainer.progress=false",
    "log.tensorboard=false",
    "model.dropout=0.1",
]
BACKOFF = ["trainer.oom_backoff=true", "fault.oom_above=2"]


def _params(tmp_path, name):
    return torch.load(tmp_path / "memorybound" / name / "results" / "params-rank0.pt", weights_only=True)


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """Micro-batches of 2 from the start (8 per rank = 4 x 2), no memory trouble."""
    tmp = tmp_path_factory.mktemp("oom_straight")
    run_target(EXP, tmp, "s", *COMMON, "trainer.accumulate=4")
    return _params(tmp, "s")


def _same(a, b):
    # the same pieces, losses weighted by the same powers of two, each rank's gradients divided by 2
    # and summed: the same floating-point operations as DDP's, so the same bits
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
@pytest.mark.timeout(200)
@pytest.mark.parametrize("where", ["forward", "backward"])
def test_out_of_memory_on_one_rank_halves_every_ranks_micro_batches_and_redoes_the_step(straight, tmp_path, where):
    out = run_target(EXP, tmp_path, "b", *COMMON, *BACKOFF, f"fault.oom_in={where}").stdout
    halvings = [line for line in out.splitlines() if "out of memory" in line]
    assert halvings == [
        "step 1: out of memory with micro-batches of 8 samples; every rank redoes the step with 4 "
        "(trainer.oom_backoff): the same global batch",
        "step 1: out of memory with micro-batches of 4 samples; every rank redoes the step with 2 "
        "(trainer.oom_backoff): the same global batch",
    ], out
    _same(_params(tmp_path, "b"), straight)


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_a_resumed_run_keeps_the_micro_batches_that_fit(straight, tmp_path):
    """Killed at step 15, resumed from step 10 on the same two ranks: no new out-of-memory."""
    fault = ["trainer.checkpoint_every=10", "fault.die_at_step=15", "--max-restarts", "1"]
    out = run_target(EXP, tmp_path, "k", *COMMON, *BACKOFF, *fault).stdout
    assert "resumed from" in out and "at step 10" in out, out
    assert "each micro-batch of 8 is cut into 4 pieces of at most 2 samples" in out, out
    after = out[out.index("resumed from") :]
    assert "out of memory" not in after, after
    _same(_params(tmp_path, "k"), straight)


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_a_resumed_run_on_fewer_ranks_starts_with_pieces_no_larger(tmp_path):
    """Saved by 2 ranks with pieces of 2; resumed on 1 rank (micro-batch 16): pieces of 2 at once,
    where the one rank, now the last, would run out of memory above 2."""
    run_target(EXP, tmp_path, "w", *COMMON, *BACKOFF, "trainer.max_steps=10", "trainer.checkpoint_every=10")
    out = run_target(EXP, tmp_path, "w", *COMMON, *BACKOFF, n=1).stdout
    assert "resumed from" in out and "out of memory" not in out, out
    assert "each micro-batch of 16 is cut into 8 pieces of at most 2 samples" in out, out


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_one_sample_that_does_not_fit_ends_the_run_in_one_line(tmp_path):
    res = run_target(EXP, tmp_path, "o", *COMMON, "trainer.oom_backoff=true", "fault.oom_above=0", expect=2)
    errors = [line for line in res.stderr.splitlines() if line.strip()]
    assert len(errors) == 1 and "step 1 ran out of memory with one sample per micro-batch" in errors[0], res.stderr
    assert "Traceback" not in res.stderr


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_without_backoff_the_out_of_memory_error_ends_the_run(tmp_path):
    res = run_target(EXP, tmp_path, "n", *COMMON, "fault.oom_above=2", expect=1)
    assert "OutOfMemoryError" in res.stderr


@pytest.mark.timeout(200)
@pytest.mark.slow
def test_a_head_no_rank_uses_on_some_steps_trains_as_under_ddp_with_backoff_on(tmp_path):
    """The auxiliary head of the UnusedHead family gets no gradient on odd steps on any rank: with
    backoff's own gradient sum it must keep none (AdamW would otherwise decay and move it), exactly
    as DDP with dist.find_unused_parameters leaves it."""
    target = "tests/fixtures/model_families.py:UnusedHead"
    common = ("trainer.max_steps=6", "trainer.global_batch_size=16", "trainer.progress=false", "log.tensorboard=false")
    run_target(target, tmp_path, "ddp", *common)
    run_target(target, tmp_path, "backoff", *common, "trainer.oom_backoff=true")
    ddp, backoff = (
        torch.load(tmp_path / "unusedhead" / run / "results" / "state-rank0.pt") for run in ("ddp", "backoff")
    )
    assert ddp.keys() == backoff.keys() and all(torch.equal(ddp[k], backoff[k]) for k in ddp)
