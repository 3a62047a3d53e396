"""dist.shard_optimizer's parts (distributed/sharding.py) in this process, on a real gloo group of one
rank: which objects the sharded optimizer replaces, the constructor settings it is made with, the whole
state a checkpoint gets, and the optimizers it refuses. What sharding does across ranks (half the state
each, bitwise resume on another world size) is tested with real processes in test_scaling.py; these
tests are the fast subset the mutation run of the module uses (scripts/mutation.py)."""

import warnings

import pytest
import torch
from torch import nn

from ddplab.distributed import sharding
from ddplab.errors import ConfigError

pytestmark = pytest.mark.timeout(60)


class Holder:
    """An experiment's attributes as build() leaves them."""


class Keywords(torch.optim.SGD):
    """An optimizer whose constructor takes any keyword: it is given every default."""

    def __init__(self, params, lr=0.1, **rest):
        self.rest = rest
        super().__init__(params, lr=lr)


class Refuses(torch.optim.SGD):
    """An optimizer that cannot be made from parameter groups alone."""

    def __init__(self, params, lr=0.1):
        if isinstance(params, list) and params and isinstance(params[0], dict):
            raise ValueError("groups are not allowed here\nsecond line")
        super().__init__(params, lr=lr)


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1))


def _train(net, optimizer, steps=3):
    for i in range(steps):
        optimizer.zero_grad()
        net(torch.full((2, 3), float(i + 1))).square().sum().backward()
        optimizer.step()


def test_the_sharded_optimizer_replaces_the_old_one_wherever_the_experiment_holds_it(gloo_group):
    net = _net()
    old = torch.optim.SGD(net.parameters(), lr=0.1)
    other = torch.optim.SGD(net.parameters(), lr=0.2)
    exp = Holder()
    others = (other,)
    exp.opt, exp.opts, exp.pair, exp.others, exp.label = old, [old, other], (other, old), others, "old"
    first = torch.optim.lr_scheduler.StepLR(old, 1)
    chained = torch.optim.lr_scheduler.SequentialLR(
        old, [torch.optim.lr_scheduler.ConstantLR(old), torch.optim.lr_scheduler.LinearLR(old)], milestones=[2]
    )
    apart = torch.optim.lr_scheduler.StepLR(other, 1)
    (zero,) = sharding.shard(exp, [old], [first, chained, apart])
    assert type(zero).__name__ == "ZeroRedundancyOptimizer"
    assert exp.opt is zero and exp.opts[0] is zero and exp.opts[1] is other
    assert exp.pair[0] is other and exp.pair[1] is zero
    # a tuple without it is left as it was, the very object
    assert exp.others is others and exp.label == "old"
    assert first.optimizer is zero and chained.optimizer is zero
    assert all(child.optimizer is zero for child in chained._schedulers)
    assert apart.optimizer is other


def test_an_optimizer_the_experiment_sharded_itself_is_kept_and_another_is_wrapped(gloo_group):
    net = _net()
    from torch.distributed.optim import ZeroRedundancyOptimizer

    own = ZeroRedundancyOptimizer(net.parameters(), optimizer_class=torch.optim.SGD, lr=0.1)
    plain = torch.optim.Adam(net.parameters(), lr=0.1)
    exp = Holder()
    exp.own, exp.plain = own, plain
    kept, wrapped = sharding.shard(exp, [own, plain], [])
    assert kept is own and exp.own is own
    assert wrapped is not plain and exp.plain is wrapped and type(wrapped.optim) is torch.optim.Adam


def test_every_setting_of_the_optimizer_reaches_the_sharded_one(gloo_group):
    net = _net()
    adamw = torch.optim.AdamW(
        [{"params": net[0].parameters(), "lr": 0.01}, {"params": net[2].parameters(), "lr": 0.02}],
        lr=0.5,
        weight_decay=0.3,
        betas=(0.8, 0.9),
    )
    zero = sharding._wrap(adamw)
    assert type(zero.optim) is torch.optim.AdamW
    assert [g["lr"] for g in zero.optim.param_groups] == [0.01, 0.02]
    assert all(g["weight_decay"] == 0.3 and g["betas"] == (0.8, 0.9) for g in zero.optim.param_groups)
    assert zero.optim.defaults["lr"] == 0.5
    # a constructor that takes any keyword is given every default, not only the ones it names
    keywords = sharding._wrap(Keywords(net.parameters(), lr=0.1))
    assert {"momentum", "weight_decay", "nesterov"} <= set(keywords.optim.rest)


def test_the_sharded_state_is_the_whole_state_and_its_kind_is_the_inner_optimizer(gloo_group):
    net, twin = _net(), _net()
    plain = torch.optim.Adam(twin.parameters(), lr=0.1)
    zero = sharding._wrap(torch.optim.Adam(net.parameters(), lr=0.1))
    _train(net, zero)
    _train(twin, plain)
    assert sharding.kind(zero) == "Adam" and sharding.kind(plain) == "Adam"
    full, expected = sharding.full_state(zero), sharding.full_state(plain)
    assert expected == plain.state_dict()
    assert sorted(full["state"]) == sorted(expected["state"]) == [0, 1, 2, 3]
    for index, state in expected["state"].items():
        assert all(torch.equal(full["state"][index][key], value) for key, value in state.items())
    # one rank holds it all here: Adam keeps two moments (and a step count) per parameter
    moments = 2 * 4 * sum(p.numel() for p in net.parameters())
    assert sharding.state_bytes(zero) == sharding.state_bytes(plain) == moments + 4 * 4


def test_a_scheduler_steps_the_sharded_optimizer_without_torchs_order_warning(gloo_group):
    net = _net()
    old = torch.optim.SGD(net.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(old, 1, gamma=0.5)
    exp = Holder()
    exp.opt = old
    (zero,) = sharding.shard(exp, [old], [scheduler])
    before = [p.detach().clone() for p in net.parameters()]
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        _train(net, zero, steps=1)
        scheduler.step()
    assert [str(w.message) for w in seen if "lr_scheduler" in str(w.message)] == []
    assert zero.param_groups[0]["lr"] == 0.05
    assert all(not torch.equal(a, b) for a, b in zip(before, net.parameters(), strict=True))


def test_optimizers_that_cannot_be_sharded_are_one_line(gloo_group):
    net = _net()
    with pytest.raises(ConfigError) as lbfgs:
        sharding._wrap(torch.optim.LBFGS(net.parameters()))
    assert lbfgs.value.cause.startswith("dist.shard_optimizer cannot shard LBFGS: its step treats")
    assert lbfgs.value.fix == "use dist.shard_optimizer=false with LBFGS"
    with pytest.raises(ConfigError) as refused:
        sharding._wrap(Refuses(net.parameters()))
    assert refused.value.cause == "dist.shard_optimizer cannot shard Refuses: groups are not allowed here"
    assert refused.value.fix == "use dist.shard_optimizer=false for this optimizer"


def test_an_unsharded_optimizer_is_its_own_kind():
    plain = torch.optim.SGD(_net().parameters(), lr=0.1)
    assert sharding.kind(plain) == "SGD" and not sharding._is_sharded(plain)
