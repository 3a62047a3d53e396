"""The data order's promises, checked as properties over many shapes (no processes needed)."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import default_collate

from ddplab.errors import ConfigError
from ddplab.train.data import BatchPlan, GlobalBatchSampler, epoch_order, eval_shard, steps_per_epoch, train_loader


@st.composite
def layouts(draw):
    world = draw(st.integers(1, 6))
    accumulate = draw(st.integers(1, 4))
    micro = draw(st.integers(1, 5))
    n = draw(st.integers(world * accumulate * micro, 200))
    return n, BatchPlan(world * accumulate * micro, world, accumulate), draw(st.integers(0, 3))


@settings(max_examples=60, deadline=None)
@given(layouts())
def test_ranks_together_take_exactly_each_global_batch_in_order(layout):
    n, plan, epoch = layout
    order = epoch_order(n, seed=7, epoch=epoch)
    per_rank = [list(GlobalBatchSampler(n, plan, r, seed=7, epoch=epoch)) for r in range(plan.world_size)]
    steps = steps_per_epoch(n, plan.global_batch)
    for s in range(steps):
        taken = []
        for r in range(plan.world_size):
            micro = per_rank[r][s * plan.accumulate : (s + 1) * plan.accumulate]
            assert all(len(m) == plan.micro_batch for m in micro)
            taken += [i for m in micro for i in m]
        assert taken == order[s * plan.global_batch : (s + 1) * plan.global_batch].tolist()


@settings(max_examples=40, deadline=None)
@given(layouts(), st.integers(0, 50))
def test_resume_starts_exactly_where_it_stopped(layout, cut):
    n, plan, epoch = layout
    steps = steps_per_epoch(n, plan.global_batch)
    start = cut % (steps + 1)
    full = list(GlobalBatchSampler(n, plan, 0, seed=3, epoch=epoch))
    resumed = list(GlobalBatchSampler(n, plan, 0, seed=3, epoch=epoch, start_step=start))
    assert resumed == full[start * plan.accumulate :]


def test_indices_converted_a_chunk_of_steps_at_a_time_keep_the_order(monkeypatch):
    # 41 steps: chunks of 5 end mid-epoch
    n, plan, rank, start = 500, BatchPlan(12, 3, 2), 1, 4
    order = epoch_order(n, seed=5, epoch=1).tolist()
    expected = [
        order[s * 12 + rank * 4 + a * 2 : s * 12 + rank * 4 + (a + 1) * 2] for s in range(start, 41) for a in range(2)
    ]
    monkeypatch.setattr(GlobalBatchSampler, "STEPS_PER_CHUNK", 5)
    assert list(GlobalBatchSampler(n, plan, rank, seed=5, epoch=1, start_step=start)) == expected


def test_same_global_batches_at_any_world_size():
    n, g = 100, 12
    for world in (1, 2, 3, 4, 6):
        plan = BatchPlan(g, world, 1)
        batches = [list(GlobalBatchSampler(n, plan, r, seed=1, epoch=2)) for r in range(world)]
        step0 = sorted(i for r in range(world) for i in batches[r][0])
        assert step0 == sorted(epoch_order(n, 1, 2)[:g].tolist())


@given(st.integers(0, 300), st.integers(1, 9))
def test_eval_shards_partition_the_dataset_without_padding(n, world):
    shards = [eval_shard(n, r, world) for r in range(world)]
    assert [i for s in shards for i in s] == list(range(n))
    assert max(map(len, shards)) - min(map(len, shards)) <= 1


@given(st.integers(0, 300), st.integers(1, 9), st.integers(1, 40))
def test_prediction_shards_are_whole_batches_so_every_batch_is_the_same_at_any_world_size(n, world, unit):
    shards = [eval_shard(n, r, world, unit) for r in range(world)]
    assert [i for s in shards for i in s] == list(range(n))
    # batches of `unit` from the shard's start
    assert all(s.start % unit == 0 for s in shards if len(s))
    # batches per rank differ by at most one
    whole = [len(s) // unit + (len(s) % unit > 0) for s in shards]
    assert max(whole) - min(whole) <= 1


def test_batch_plan_errors():
    with pytest.raises(ConfigError, match=r"does not divide into 4 ranks x 2 micro-batches.*a multiple of 8 "):
        BatchPlan(12, 4, 2)
    smallest = BatchPlan(1, 1, 1)
    assert (smallest.micro_batch, smallest.per_rank) == (1, 1)
    assert (BatchPlan(24, 3, 2).micro_batch, BatchPlan(24, 3, 2).per_rank) == (4, 8)


def test_no_two_seeds_or_epochs_share_an_order():
    """(seed, epoch) pairs that a careless mix (seed + epoch, seed ^ epoch) would confuse."""
    orders = {(seed, epoch): tuple(epoch_order(50, seed, epoch).tolist()) for seed in range(4) for epoch in range(4)}
    assert len(set(orders.values())) == len(orders)


def test_the_sampler_length_is_what_it_yields():
    for start in (0, 3, 8):
        sampler = GlobalBatchSampler(83, BatchPlan(10, 2, 5), 1, seed=2, epoch=0, start_step=start)
        assert len(sampler) == len(list(sampler)) == (8 - start) * 5


class RandomDraws(torch.utils.data.Dataset):
    """Each sample draws from numpy and Python's random, as augmentation does."""

    def __len__(self):
        return 16

    def __getitem__(self, i):
        import random

        import numpy as np

        return torch.tensor([np.random.rand(), random.random()], dtype=torch.float64)


def test_loader_workers_draw_reproducible_and_different_random_numbers():
    def draws(epoch):
        loader = train_loader(
            RandomDraws(),
            BatchPlan(4, 1, 1),
            0,
            seed=3,
            epoch=epoch,
            start_step=0,
            collate_fn=default_collate,
            num_workers=2,
            pin_memory=False,
        )
        return torch.cat(list(loader))

    first = draws(0)
    # the same run draws the same numbers again
    assert torch.equal(first, draws(0))
    # worker 1 is not a copy of worker 0
    assert len(set(first[:, 0].tolist())) == len(first)
    assert not torch.equal(first, draws(1))
