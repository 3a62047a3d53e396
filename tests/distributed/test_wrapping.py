"""DDP wrapping in a real (one-process) gloo group: the user's attributes stay reachable."""

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

from ddplab.config import DistConfig
from ddplab.distributed.wrapping import DDP, _note_dropout, compile_network, dropout_layers, unwrap, wrap
from ddplab.errors import ConfigError


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, 2)
        self.alignment_layers = [self.fc]

    def forward(self, x):
        return self.fc(x)

    def describe(self):
        return "custom method"


@pytest.mark.timeout(60)
# both set on purpose: each must arrive
@pytest.mark.filterwarnings("ignore:You passed find_unused_parameters")
def test_wrapped_network_keeps_its_attributes_and_methods(gloo_group):
    net = Net()
    reference = copy.deepcopy(net)
    settings = DistConfig(
        bucket_cap_mb=1.5,
        static_graph=True,
        find_unused_parameters=True,
        gradient_as_bucket_view=False,
        broadcast_buffers=False,
    )
    wrapped = wrap(net, settings, torch.device("cpu"), distributed=True)
    assert isinstance(wrapped, DDP) and unwrap(wrapped) is net
    # Every dist.* DDP setting reached DDP itself.
    assert wrapped.bucket_bytes_cap == int(1.5 * 1024 * 1024) and wrapped.static_graph is True
    assert wrapped.find_unused_parameters is True and wrapped.gradient_as_bucket_view is False
    # torch 2.13 names it forward_sync_buffers, torch 2.11 broadcast_buffers
    assert getattr(wrapped, "forward_sync_buffers", wrapped.broadcast_buffers) is False
    # no `.module` needed
    assert wrapped.alignment_layers[0] is net.fc
    assert wrapped.describe() == "custom method"
    assert wrapped.fc is net.fc
    x = torch.randn(4, 3)
    # through DDP's forward and its gradient hooks
    wrapped(x).square().sum().backward()
    # plain autograd: a world of one averages over itself
    reference(x).square().sum().backward()
    assert torch.allclose(net.fc.weight.grad, reference.fc.weight.grad)
    assert torch.allclose(net.fc.bias.grad, reference.fc.bias.grad)


def _buckets_of_a_step(settings: DistConfig) -> list[int]:
    """How many parameters each gradient bucket held in the second step (DDP lays its buckets out
    again after the first, in the order the gradients became ready)."""
    net = nn.Sequential(nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 512))
    wrapped = wrap(net, settings, torch.device("cpu"), distributed=True)
    seen: dict[int, int] = {}

    def record(_, bucket):
        seen[bucket.index()] = len(bucket.parameters())
        fut = torch.futures.Future()
        fut.set_result(bucket.buffer())
        return fut

    wrapped.register_comm_hook(None, record)
    for _ in range(2):
        seen.clear()
        wrapped(torch.randn(4, 512)).sum().backward()
    return [seen[i] for i in sorted(seen)]


@pytest.mark.timeout(60)
def test_the_first_bucket_is_sent_while_the_backward_runs_on(gloo_group):
    """Unset, dist.bucket_cap_mb leaves DDP its small first bucket: the last layer's gradients (1 MiB)
    go out alone, before the first layer's are computed. A value given is every bucket's size."""
    assert _buckets_of_a_step(DistConfig()) == [2, 2]
    assert _buckets_of_a_step(DistConfig(bucket_cap_mb=25)) == [4]
    # PowerSGD lays its buckets out in parameter order, where a small first bucket gains nothing
    assert _buckets_of_a_step(DistConfig(comm_hook="powersgd")) == [4]


def test_strategies_outside_a_group():
    net = Net()
    assert wrap(net, DistConfig(strategy="none"), torch.device("cpu"), distributed=True) is net
    assert wrap(net, DistConfig(strategy="ddp"), torch.device("cpu"), distributed=False) is net
    # no GPUs here
    assert wrap(net, DistConfig(strategy="dp"), torch.device("cpu"), distributed=False) is net


def test_detail_debugging_is_refused_for_ddp_instead_of_crashing(gloo_group):
    """With the pinned torch, DETAIL debugging crashes (SIGSEGV) in DDP's constructor."""
    try:
        dist.set_debug_level(dist.DebugLevel.DETAIL)
        with pytest.raises(ConfigError, match=r"dist.debug=detail crashes inside DistributedDataParallel"):
            wrap(Net(), DistConfig(), torch.device("cpu"), distributed=True)
        dist.set_debug_level(dist.DebugLevel.OFF)
        assert isinstance(wrap(Net(), DistConfig(), torch.device("cpu"), distributed=True), DDP)
    finally:
        dist.set_debug_level(dist.DebugLevel.OFF)


def test_compile_over_data_parallel_is_refused_in_one_line():
    """DataParallel copies its network to each GPU on every call; torch.compile would not reach the
    copies, so trainer.compile with dist.strategy=dp says so instead of training uncompiled."""
    with pytest.raises(ConfigError, match=r"does not reach the replicas of dist.strategy=dp") as refused:
        compile_network(nn.DataParallel(Net()), "true", torch.device("cpu"))
    assert "use dist.strategy=ddp" in str(refused.value) and "\n" not in str(refused.value)
    compiled = compile_network(Net(), "true", torch.device("cpu"))
    assert unwrap(compiled).__class__ is Net and compiled is not unwrap(compiled)


def test_dropout_that_drops_is_named_beside_the_banner(capsys):
    net = nn.Sequential(nn.Linear(2, 2), nn.Dropout(0.1), nn.Dropout(0.0), nn.Dropout2d(0.2))
    assert dropout_layers(net) == ["1", "3"]
    _note_dropout(net)
    out = capsys.readouterr().out
    assert out.startswith("ddplab: note: Sequential has dropout (1, 3): each rank draws its own masks")
    _note_dropout(nn.Sequential(nn.Linear(2, 2), nn.Dropout(0.0)))
    assert capsys.readouterr().out == ""
