"""DDP's levers with real gloo processes: gradient compression (fp16, PowerSGD with its state across
a SIGKILL), optimizer-state sharding (ZeroRedundancyOptimizer, resumed on another world size),
BatchNorm under DDP (the warning, broadcast_buffers) and the refusals before any worker starts."""

import json

import pytest
import torch

from helpers import ddplab_here, experiment_of, run_target, summary_of

EXP = "tests/fixtures/scaling.py:Levers"
COMMON = [
    "trainer.progress=false",
    "log.tensorboard=false",
    "trainer.global_batch_size=32",
    "model.dropout=0.1",
    "trainer.max_steps=24",
]
# PowerSGD from step 2, over several gradient buckets, with accumulation (no_sync)
POWERSGD = ["dist.comm_hook=powersgd", "dist.powersgd_start_iter=2", "dist.bucket_cap_mb=0.001", "trainer.accumulate=2"]
pytestmark = pytest.mark.timeout(60)


def _run(tmp_path, name, *args, n=2, expect=0):
    return run_target(EXP, tmp_path, name, *COMMON, *args, n=n, expect=expect)


def _results(tmp_path, name):
    return torch.load(tmp_path / "levers" / name / "results" / "final.pt", weights_only=True)["params"]


def _per_rank(tmp_path, name, rank):
    return json.loads((tmp_path / "levers" / name / "results" / f"rank{rank}.json").read_text())


def _checkpoint(tmp_path, name, step):
    path = tmp_path / "levers" / name / "checkpoints" / f"step-{step:08d}" / "state.pt"
    return torch.load(path, weights_only=True)


def _bitwise_equal(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def powersgd_straight(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("powersgd")
    _run(tmp, "ref", *POWERSGD, "trainer.checkpoint_every=10")
    return tmp


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_powersgd_state_is_saved_and_a_killed_run_resumes_bitwise(tmp_path, powersgd_straight):
    straight = _results(powersgd_straight, "ref")
    # the rank that dies at step 15 restarts from step 10's checkpoint, in the middle of epoch 0
    out = _run(tmp_path, "k", *POWERSGD, "trainer.checkpoint_every=10", "fault.die_at_step=15", "--max-restarts", "1")
    assert "restarted after a failure (restart 1" in out.stdout and "at step 10" in out.stdout
    assert _bitwise_equal(_results(tmp_path, "k"), straight)
    # saving takes PowerSGD's state apart and puts it back: a run that never saves trains the same
    _run(tmp_path, "unsaved", *POWERSGD)
    assert _bitwise_equal(_results(tmp_path, "unsaved"), straight)
    saved = _checkpoint(powersgd_straight, "ref", 20)["comm_hooks"]
    # one state per rank: each rank's own compression error per parameter, and the same factors
    # of the matrices worth compressing (not the 2 x 32 output layer)
    assert len(saved) == 2 and saved[0]["net"]["iter"] == 20
    errors = [saved[rank]["net"]["error"] for rank in range(2)]
    assert sorted(errors[0]) == list(range(6)) and not torch.equal(errors[0][0], errors[1][0])
    assert sorted(saved[0]["net"]["q"]) == [0, 2] and torch.equal(saved[0]["net"]["q"][2], saved[1]["net"]["q"][2])


@pytest.mark.timeout(300)
@pytest.mark.slow
def test_compression_changes_the_gradients_it_sends(tmp_path, powersgd_straight):
    """Each hook is really in the all_reduce, on gloo too: the trained weights differ from the
    uncompressed run's, fp16 and bf16 only a little, bf16 (fewer bits of mantissa) more than fp16."""
    for hook in ("none", "fp16", "bf16"):
        _run(tmp_path, hook, f"dist.comm_hook={hook}", "dist.bucket_cap_mb=0.001", "trainer.accumulate=2")
    plain, fp16, bf16 = (_results(tmp_path, hook) for hook in ("none", "fp16", "bf16"))
    powersgd = _results(powersgd_straight, "ref")
    assert not _bitwise_equal(plain, fp16) and not _bitwise_equal(plain, powersgd)
    assert all(torch.allclose(plain[k], fp16[k], atol=1e-3) for k in plain)
    assert all(torch.allclose(plain[k], bf16[k], atol=5e-3) for k in plain)

    def furthest(compressed):
        return max((plain[k] - compressed[k]).abs().max().item() for k in plain)

    assert furthest(fp16) < furthest(bf16)


@pytest.mark.timeout(300)
@pytest.mark.slow
def test_powersgd_runs_compiled(tmp_path):
    # torch.compile needs buckets of 1 MiB or more: one bucket here
    settings = [s for s in POWERSGD if not s.startswith("dist.bucket_cap_mb")]
    _run(tmp_path, "eager", *settings)
    _run(tmp_path, "c", *settings, "trainer.compile=true")
    compiled, eager = _results(tmp_path, "c"), _results(tmp_path, "eager")
    assert all(torch.allclose(compiled[k], eager[k], rtol=1e-4, atol=1e-5) for k in eager)


@pytest.fixture(scope="module")
def sharded_straight(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sharded")
    _run(tmp, "ref", "model.optimizer=adam", "dist.shard_optimizer=true", "trainer.checkpoint_every=10")
    return tmp


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_sharded_optimizer_holds_half_the_state_and_a_killed_run_resumes_bitwise(tmp_path, sharded_straight):
    _run(tmp_path, "plain", "model.optimizer=adam")
    ranks = [_per_rank(sharded_straight, "ref", rank) for rank in range(2)]
    plain = _per_rank(tmp_path, "plain", 0)
    assert [r["optimizer"] for r in ranks] == ["ZeroRedundancyOptimizer"] * 2 and plain["optimizer"] == "Adam"
    assert sum(r["state_bytes"] for r in ranks) == plain["state_bytes"]
    # whole parameters are shared out: here one 32 x 32 matrix is most of the state
    assert min(r["state_bytes"] for r in ranks) > 0 and max(r["state_bytes"] for r in ranks) < plain["state_bytes"]
    # the same Adam, updated shard by shard
    assert _bitwise_equal(_results(sharded_straight, "ref"), _results(tmp_path, "plain"))
    out = _run(
        tmp_path, "k", "model.optimizer=adam", "dist.shard_optimizer=true", "trainer.checkpoint_every=10",
        "fault.die_at_step=15", "--max-restarts", "1",
    )  # fmt: skip
    assert "at step 10" in out.stdout
    assert _bitwise_equal(_results(tmp_path, "k"), _results(sharded_straight, "ref"))


@pytest.mark.timeout(300)
@pytest.mark.slow
def test_sharded_checkpoints_resume_on_another_world_size_and_unsharded(tmp_path, sharded_straight):
    """A sharded checkpoint holds the whole optimizer state: 2 sharded ranks -> 1 process -> 2 sharded."""
    # AdamW: its defaults hold a setting its constructor does not take (decoupled_weight_decay)
    adam = ["model.optimizer=adamw", "model.dropout=0.0", "trainer.checkpoint_every=8"]
    _run(tmp_path, "ref", *adam, "dist.shard_optimizer=true")
    _run(tmp_path, "mixed", *adam, "dist.shard_optimizer=true", "trainer.max_steps=8")
    saved = _checkpoint(tmp_path, "mixed", 8)["optimizers"][0]
    # every parameter's moments, as torch.optim.Adam keeps them
    assert sorted(saved["state"]) == list(range(6)) and set(saved["state"][0]) == {"step", "exp_avg", "exp_avg_sq"}
    _run(tmp_path, "mixed", *adam, "trainer.max_steps=16", n=1)
    _run(tmp_path, "mixed", *adam, "dist.shard_optimizer=true")
    a, b = _results(tmp_path, "ref"), _results(tmp_path, "mixed")
    assert all(torch.allclose(a[k], b[k], rtol=1e-5, atol=1e-6) for k in a)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_zero_optimizer_built_by_the_experiment_is_checkpointed_and_resumed(tmp_path, sharded_straight):
    _run(tmp_path, "r", "model.optimizer=zero", "trainer.checkpoint_every=10", "trainer.max_steps=10")
    out = _run(tmp_path, "r", "model.optimizer=zero", "trainer.checkpoint_every=10").stdout
    assert "resumed from" in out
    # the experiment's own ZeroRedundancyOptimizer over Adam trains what dist.shard_optimizer's does
    assert _bitwise_equal(_results(sharded_straight, "ref"), _results(tmp_path, "r"))


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_batchnorm_across_ranks_is_named_once_and_broadcast_buffers_is_passed_to_ddp(tmp_path):
    res = _run(tmp_path, "bn", "model.batchnorm=true", "dist.broadcast_buffers=false")
    warning = [line for line in (res.stdout + res.stderr).splitlines() if "BatchNorm layers" in line]
    assert len(warning) == 1 and "1: BatchNorm1d" in warning[0] and "depends on the world size" in warning[0]
    # without the copy from rank 0, each rank keeps the statistics of its own micro-batches
    ranks = [_per_rank(tmp_path, "bn", rank)["buffers"]["1.running_mean"] for rank in range(2)]
    assert ranks[0] != ranks[1]
    # with it (the default), every rank ends with rank 0's statistics: the step modes' test below
    one = _run(tmp_path, "one", "model.batchnorm=true", n=1)
    assert "BatchNorm layers" not in one.stdout + one.stderr


# every way ddplab can run a step; each is checked below on 2 ranks with BatchNorm and each rank's own data
STEP_MODES = {
    "ddp": [],
    "accumulate": ["trainer.accumulate=2"],
    "oom_backoff": ["trainer.oom_backoff=true"],
    "fp16_hook": ["dist.comm_hook=fp16"],
    "powersgd": POWERSGD,
    "sharded_optimizer": ["model.optimizer=adam", "dist.shard_optimizer=true"],
}


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", STEP_MODES)
def test_every_step_mode_keeps_one_set_of_buffers_and_evaluates_as_one_rank_would(tmp_path, mode):
    run = tmp_path / "levers" / mode
    _run(tmp_path, mode, "model.batchnorm=true", "trainer.max_steps=12", "trainer.eval_every=12", *STEP_MODES[mode])
    # each rank normalized its own micro-batches; all hold rank 0's statistics, the ones saved
    ranks = [_per_rank(tmp_path, mode, rank)["buffers"] for rank in range(2)]
    assert ranks[0] == ranks[1] and set(ranks[0]) == {"1.running_mean", "1.running_var"}
    saved = _checkpoint(tmp_path, mode, 12)["models"]["net"]["1.running_mean"]
    assert saved.tolist() == ranks[0]["1.running_mean"]
    # the evaluation both ranks made is the one a single process (this one) makes of the saved weights
    alone = experiment_of(EXP, run).evaluate_checkpoint(str(run))
    together = summary_of(run)["last_eval"]
    assert together == pytest.approx({k: v for k, v in alone.items() if k in together}, rel=1e-6)


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("step", [[], ["trainer.oom_backoff=true"]], ids=["ddp", "oom_backoff"])
def test_a_buffer_the_forward_updates_from_each_ranks_batch_is_named_once(tmp_path, step):
    res = _run(tmp_path, "centre", "model.running_mean=true", "trainer.max_steps=4", *step)
    warning = [line for line in (res.stdout + res.stderr).splitlines() if "differ between ranks" in line]
    # its running mean, not its call count (equal on every rank) nor BatchNorm's statistics
    assert len(warning) == 1 and "the buffers 1.mean changed" in warning[0], res.stderr
    assert "depends on the world size" in warning[0] and "calls" not in warning[0]
    # once rank 0's copy is kept, every rank ends with the same statistics
    ranks = [_per_rank(tmp_path, "centre", rank)["buffers"]["1.mean"] for rank in range(2)]
    assert ranks[0] == ranks[1]


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("n", [1, 2])
def test_a_reentrant_checkpoint_of_the_inputs_is_one_line_and_its_fix_trains_every_layer(tmp_path, n):
    # torch only warns, and the checkpointed layer got no gradient: silently frozen on one rank,
    # "unused parameters" (the wrong fix) on two
    res = _run(tmp_path, "reentrant", "model.checkpoint=reentrant", "trainer.max_steps=2", n=n, expect=2)
    assert "a gradient checkpoint with use_reentrant=True" in res.stderr and "use_reentrant=False" in res.stderr
    assert "Traceback" not in res.stderr and "find_unused_parameters" not in res.stderr
    # the fix it names: every layer trains, as without the checkpoint
    _run(tmp_path, "fixed", "model.checkpoint=non_reentrant", "trainer.max_steps=4", n=n)
    _run(tmp_path, "plain", "trainer.max_steps=4", n=n)
    fixed, plain = _results(tmp_path, "fixed"), _results(tmp_path, "plain")
    assert torch.equal(fixed["0.layer.weight"], plain["0.weight"])


@pytest.mark.parametrize(
    ("settings", "expected"),
    [
        (["dist.sync_batchnorm=true"], "dist.sync_batchnorm=true needs GPUs"),
        (["dist.strategy=dp", "dist.comm_hook=fp16"], "dist.comm_hook=fp16 acts on DDP's ranks"),
        (["trainer.compile=true", "dist.bucket_cap_mb=0.5"], "needs gradient buckets of at least 1 MiB"),
    ],
)
def test_levers_that_cannot_run_are_refused_before_any_worker_starts(tmp_path, settings, expected):
    res = ddplab_here("run", EXP, "-n", "2", f"run.dir={tmp_path}", "run.name=x", *settings)
    assert res.returncode != 0 and expected in res.stderr, res.stderr
    assert len(res.stderr.strip().splitlines()) <= 2
    # no worker ran: nothing was written
    assert not (tmp_path / "levers").exists()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_an_optimizer_that_cannot_be_sharded_is_named_in_one_line(tmp_path):
    res = _run(tmp_path, "lbfgs", "model.optimizer=lbfgs", "dist.shard_optimizer=true", expect=2)
    assert "dist.shard_optimizer cannot shard LBFGS" in res.stderr
    assert "Traceback" not in res.stderr
