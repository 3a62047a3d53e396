"""Gradients ddplab averages itself (distributed/gradients.py): in buckets of one dtype as large as DDP's,
every parameter once, a parameter no rank used left without a gradient; and which parameters of
several networks are shared, taken from every DDP wrapper. The runs that train shared modules on 2
and 3 ranks against one process are tests/train/test_shared_modules.py's."""

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from ddplab.distributed import gradients
from ddplab.distributed.gradients import SharedParameters, average, mean_over_ranks

pytestmark = pytest.mark.timeout(60)


def test_the_gradient_sum_uses_ddps_default_bucket(gloo_group):
    assert DDP(torch.nn.Linear(2, 2)).bucket_bytes_cap == gradients.BUCKET_BYTES


def _four_layers() -> nn.ModuleDict:
    return nn.ModuleDict(
        {"a": nn.Linear(2, 2), "b": nn.Linear(3, 1).double(), "c": nn.Linear(2, 3), "unused": nn.Linear(1, 1)}
    )


def test_gradients_are_averaged_in_buckets_of_one_dtype_and_unused_parameters_keep_none(gloo_group, monkeypatch):
    """On a group of one the all_reduce adds nothing, so what comes back is each gradient divided by
    the world size the mean was asked for: every gradient exactly once, in whichever bucket, a
    parameter listed twice (two networks hold it) too. A parameter no rank used keeps no gradient,
    as DDP leaves it (a zero one would still move it)."""
    monkeypatch.setattr(gradients, "BUCKET_BYTES", 24)
    net = _four_layers()
    frozen = nn.Linear(1, 1).requires_grad_(False)
    for name in ("a", "b", "c"):
        for p in net[name].parameters():
            p.grad = torch.arange(p.numel(), dtype=p.dtype).view_as(p) + 1
    before = {n: p.grad.clone() for n, p in net.named_parameters() if p.grad is not None}
    average([*net.parameters(), *net["a"].parameters(), *frozen.parameters()], mean_over_ranks(4))
    for n, p in net.named_parameters():
        if n.startswith("unused"):
            assert p.grad is None
            continue
        assert torch.equal(p.grad, before[n] / 4) and p.grad.dtype == p.dtype, n
    assert frozen.weight.grad is None


F32, F64 = torch.float32, torch.float64


@pytest.mark.parametrize(
    ("bucket_bytes", "buckets"),
    [
        # first which parameters any rank used (8 of them), then the gradients of those (the unused
        # layer's none): bytes a 16 + 8 (float32) | b 24 | b 8 (float64) | c 24 | c 12 (float32)
        (24, [(8, F32), (6, F32), (3, F64), (1, F64), (6, F32), (3, F32)]),
        (17, [(8, F32), (6, F32), (3, F64), (1, F64), (6, F32), (3, F32)]),
        # the first gradient fills a bucket alone: a 16 | a 8 | b 24 | b 8 | c 24 | c 12
        (16, [(8, F32), (4, F32), (2, F32), (3, F64), (1, F64), (6, F32), (3, F32)]),
    ],
)
def test_gradients_are_summed_in_buckets_of_one_dtype_up_to_the_bucket_size(
    gloo_group, monkeypatch, bucket_bytes, buckets
):
    """Which gradients share an all_reduce: the real all_reduce, each call's tensor noted on the way."""
    monkeypatch.setattr(gradients, "BUCKET_BYTES", bucket_bytes)
    real, sent = dist.all_reduce, []

    def noted(tensor, *args, **kwargs):
        sent.append((tensor.numel(), tensor.dtype))
        return real(tensor, *args, **kwargs)

    monkeypatch.setattr(dist, "all_reduce", noted)
    net = _four_layers()
    for name in ("a", "b", "c"):
        for p in net[name].parameters():
            p.grad = torch.ones_like(p)
    average(list(net.parameters()), mean_over_ranks(2))
    assert sent == buckets


class _Head(nn.Module):
    def __init__(self, trunk: nn.Module):
        super().__init__()
        self.trunk = trunk
        self.head = nn.Linear(4, 1)


def test_a_parameter_two_networks_hold_is_left_out_of_both_wrappers_and_a_buffer_of_the_second(gloo_group):
    trunk = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    first, second, alone = _Head(trunk), _Head(trunk), nn.Linear(2, 2)
    shared = SharedParameters([first, second, alone])
    assert {id(p) for p in shared.params} == {id(p) for p in trunk.parameters()}
    for network in (first, second, alone):
        shared.leave_to_ddp(network)
    # DDP then reduces only the heads, and the second network leaves the first's buffers alone
    assert set(first._ddp_params_and_buffers_to_ignore) == {
        "trunk.0.weight",
        "trunk.0.bias",
        "trunk.1.weight",
        "trunk.1.bias",
    }
    assert set(second._ddp_params_and_buffers_to_ignore) >= {"trunk.1.running_mean", "trunk.1.running_var"}
    assert not hasattr(alone, "_ddp_params_and_buffers_to_ignore")
    reduced = [p for p in DDP(second).parameters() if p.requires_grad and id(p) not in shared.ids]
    assert {id(p) for p in reduced} == {id(p) for p in second.head.parameters()}


def test_without_a_mean_shared_gradients_are_left_alone():
    """One process, or networks left unwrapped (dist.strategy=none): nothing to average."""
    trunk = nn.Linear(2, 2)
    shared = SharedParameters([_Head(trunk), _Head(trunk)])
    trunk.weight.grad = torch.ones(2, 2)
    shared.synchronize()
    assert torch.equal(trunk.weight.grad, torch.ones(2, 2))
    assert not SharedParameters([nn.Linear(2, 2), nn.Linear(2, 2)])
