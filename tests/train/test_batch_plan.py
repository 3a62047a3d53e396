"""The batch plan at any world size: trainer.accumulate=auto keeps the global batch and the
micro-batch limit (trainer.micro_batch_size), chooses the fewest micro-batches, and a world size no
plan can serve is refused naming the ones that can. Properties over many shapes, then real runs."""

import re
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ddplab.errors import ConfigError
from ddplab.launch.cli import _check_batch_plans
from ddplab.launch.launcher import LaunchOptions
from ddplab.train.data import plan_batches
from helpers import ddplab_here, run_target


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 512), st.integers(1, 16), st.integers(1, 64))
def test_auto_keeps_the_global_batch_within_the_limit_with_the_fewest_micro_batches(global_batch, world, limit):
    try:
        plan = plan_batches(global_batch, world, "auto", limit)
    except ConfigError as e:
        # no plan: no accumulation cuts this rank's share into equal micro-batches within the limit
        assert global_batch < world or global_batch % world or "world sizes" in e.cause
        if global_batch >= world and global_batch % world == 0:
            per_rank = global_batch // world
            assert not any(per_rank % a == 0 and per_rank // a <= limit for a in range(1, per_rank + 1))
        return
    assert plan.world_size * plan.accumulate * plan.micro_batch == global_batch
    assert plan.micro_batch <= limit and plan.chosen
    # fewer micro-batches would not divide the share, or would pass the limit
    per_rank = global_batch // world
    assert all(per_rank % a or per_rank // a > limit for a in range(1, plan.accumulate))


def _suggested(fix: str, global_batch: int, world: int, accumulate: str, limit: int | None):
    """Each fix a refusal names, applied alone: (global batch, world size, accumulate, limit)."""
    for found in re.finditer(r"trainer.global_batch_size=(\d+)", fix):
        yield int(found.group(1)), world, accumulate, limit
    for found in re.finditer(r"trainer.accumulate=(\w+)", fix):
        yield global_batch, world, found.group(1), limit
    if sizes := re.search(r"world sizes: ([\d, .]+)$", fix):
        for size in re.findall(r"\d+", sizes.group(1)):
            yield global_batch, int(size), accumulate, limit


@settings(max_examples=300, deadline=None)
@given(
    st.integers(1, 300),
    st.integers(1, 12),
    st.sampled_from(["auto", "1", "2", "3", "4", "8"]),
    st.one_of(st.none(), st.integers(1, 64)),
)
def test_every_fix_a_refused_plan_names_is_accepted_on_its_own(global_batch, world, accumulate, limit):
    """The fix is applied as the line gives it, the other settings left as they were: a global batch
    that divides but breaks the micro-batch limit, or an accumulation that fits but does not divide,
    would be a second refusal."""
    try:
        plan_batches(global_batch, world, accumulate, limit)
    except ConfigError as e:
        suggested = list(_suggested(e.fix, global_batch, world, accumulate, limit))
        assert suggested, e.fix
        for fixed in suggested:
            assert plan_batches(*fixed).global_batch == fixed[0]


@settings(max_examples=200, deadline=None)
@given(
    st.integers(1, 200),
    st.integers(1, 4),
    st.integers(1, 3),
    st.integers(0, 3),
    st.sampled_from(["auto", "1", "2", "4"]),
    st.one_of(st.none(), st.integers(1, 64)),
)
def test_an_elastic_range_refused_names_a_global_batch_that_serves_every_world_size_in_it(
    global_batch, per_node, low, wider, accumulate, limit
):
    trainer = SimpleNamespace(global_batch_size=global_batch, accumulate=accumulate, micro_batch_size=limit)
    opts = LaunchOptions(nproc_per_node=str(per_node), nnodes=f"{low}:{low + wider}")
    try:
        _check_batch_plans(trainer, opts)
    except ConfigError as e:
        if found := re.search(r"use trainer.global_batch_size=(\d+)", e.fix):
            _check_batch_plans(SimpleNamespace(**{**vars(trainer), "global_batch_size": int(found.group(1))}), opts)
        else:
            assert e.fix.startswith("use a narrower --nnodes"), e.fix


def test_the_same_global_batch_at_every_world_size_that_can_keep_it():
    plans = {w: plan_batches(32, w, "auto", 8) for w in (1, 2, 4, 8)}
    assert {w: (p.micro_batch, p.accumulate) for w, p in plans.items()} == {1: (8, 4), 2: (8, 2), 4: (8, 1), 8: (4, 1)}
    with pytest.raises(ConfigError) as refused:
        plan_batches(32, 3, "auto", 8)
    assert "does not divide into 3 ranks" in refused.value.cause
    assert (
        refused.value.fix == "use trainer.global_batch_size=33, or run on one of these world sizes: 1, 2, 4, 8, 16, 32"
    )


def test_a_fixed_accumulation_above_the_limit_names_the_one_that_fits():
    with pytest.raises(ConfigError) as refused:
        plan_batches(64, 2, "1", 16)
    assert "micro-batches of 32 samples, more than trainer.micro_batch_size=16" in refused.value.cause
    assert refused.value.fix == (
        "use trainer.global_batch_size=32 or trainer.accumulate=2, or run on one of these world sizes: 4, 8, 16, 32, 64"
    )
    assert plan_batches(64, 2, "2", 16).micro_batch == 16
    # below the limit is as good as at it
    assert plan_batches(64, 2, "4", 16).micro_batch == 8
    # "auto" as the config gives it, a string of its own (not the interned literal)
    assert plan_batches(64, 2, "".join(["au", "to"]), 16).accumulate == 2
    # the run's first line says "(auto)" only for an accumulation ddplab chose
    assert not plan_batches(64, 2, "4", 16).chosen and plan_batches(64, 2, "auto", 16).chosen


@pytest.mark.parametrize(
    ("global_batch", "sizes"),
    [
        # twelve world sizes can keep 60: all are named
        (60, "1, 2, 3, 4, 5, 6, 10, 12, 15, 20, 30, 60"),
        # fifteen can keep 120 (up to 64 ranks): the first twelve, then "..."
        (120, "1, 2, 3, 4, 5, 6, 8, 10, 12, 15, 20, 24, ..."),
        # thirteen can keep 144: one is left out, and "..." says so
        (144, "1, 2, 3, 4, 6, 8, 9, 12, 16, 18, 24, 36, ..."),
        # a global batch below 64 ranks is kept by as many ranks as it has samples
        (45, "1, 3, 5, 9, 15, 45"),
        # 64 ranks, the most the list looks at, can keep 128 ...
        (128, "1, 2, 4, 8, 16, 32, 64"),
        # ... and 65 ranks could keep 130, but are not listed
        (130, "1, 2, 5, 10, 13, 26"),
    ],
)
def test_the_world_sizes_that_can_keep_a_global_batch_are_named_up_to_twelve(global_batch, sizes):
    with pytest.raises(ConfigError) as refused:
        plan_batches(global_batch, 7, "auto", global_batch)
    assert refused.value.fix.endswith(f", or run on one of these world sizes: {sizes}")


def test_a_global_batch_smaller_than_the_world_is_refused():
    with pytest.raises(ConfigError, match="smaller than the world size"):
        plan_batches(2, 4, "1", None)


EXP = "tests/fixtures/experiments.py:Classifier"
COMMON = ["trainer.progress=false", "log.tensorboard=false", "trainer.global_batch_size=32", "model.dropout=0.0"]


def _run(tmp_path, name, *args, n=2, expect=0):
    return run_target(EXP, tmp_path, name, *COMMON, *args, n=n, expect=expect)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_auto_replans_on_another_world_size_and_trains_the_same_global_batches(tmp_path):
    auto = ["trainer.accumulate=auto", "trainer.micro_batch_size=8"]
    out = _run(tmp_path, "two", *auto, "trainer.max_steps=24").stdout
    assert "micro-batch 8 per rank x accumulate 2 (auto) x 2 ranks = global batch 32" in out
    _run(tmp_path, "mixed", *auto, "trainer.max_steps=12")
    out = _run(tmp_path, "mixed", *auto, "trainer.max_steps=24", n=1).stdout
    assert "micro-batch 8 per rank x accumulate 4 (auto) x 1 ranks" in out
    assert "cut into micro-batches of 8 x 2, now 8 x 4 per rank: the same global batches" in out
    saved = torch.load(
        tmp_path / "classifier" / "mixed" / "checkpoints" / "step-00000024" / "state.pt", weights_only=True
    )["sampler"]
    assert (saved["accumulate"], saved["micro_batch"]) == (4, 8)
    a = torch.load(tmp_path / "classifier" / "two" / "results" / "final.pt", weights_only=True)["params"]
    b = torch.load(tmp_path / "classifier" / "mixed" / "results" / "final.pt", weights_only=True)["params"]
    # the same global batches; sums over another split of each batch round differently
    assert all(torch.allclose(a[k], b[k], rtol=1e-5, atol=1e-6) for k in a)


@pytest.mark.parametrize(
    ("settings", "expected"),
    [
        (["trainer.accumulate=auto"], "trainer.accumulate=auto chooses the accumulation"),
        (
            ["trainer.accumulate=auto", "trainer.micro_batch_size=8", "trainer.global_batch_size=33"],
            "does not divide into 2 ranks; use trainer.global_batch_size=34",
        ),
        (["trainer.global_batch_size=1"], "smaller than the world size (2 ranks)"),
        (["trainer.micro_batch_size=0"], "trainer.micro_batch_size"),
        (["trainer.oom_backoff=true", "dist.comm_hook=fp16"], "trainer.oom_backoff cannot run with dist.comm_hook"),
        (["trainer.oom_backoff=true", "dist.strategy=dp"], "trainer.oom_backoff cannot run with dist.strategy=dp"),
    ],
)
def test_plans_that_cannot_work_are_refused_before_any_worker_starts(tmp_path, settings, expected):
    res = ddplab_here("run", EXP, "-n", "2", f"run.dir={tmp_path}", "run.name=x", *settings)
    assert res.returncode != 0 and expected in res.stderr, res.stderr
    assert len(res.stderr.strip().splitlines()) <= 2
    assert not (tmp_path / "classifier").exists()
