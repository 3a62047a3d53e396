"""Optimizer state split across ranks (`dist.shard_optimizer`): torch's ZeroRedundancyOptimizer in
place of each optimizer an experiment's build() made, and a whole optimizer state in checkpoints.

Each rank keeps the state (momentum, Adam's moments) of about 1/W of the parameters, updates only
those, and the updated parameters are broadcast from their owners. A checkpoint gathers the shards
into one ordinary optimizer state on rank 0 (a collective), so a sharded run resumes on any world
size, sharded or not, and a checkpoint of an unsharded run resumes sharded."""

import functools
import inspect
import sys

import torch

from ..errors import ConfigError


def shard(exp, optimizers: list, schedulers: list) -> list:
    """A ZeroRedundancyOptimizer in place of each optimizer: in the returned list, on the experiment's
    attributes and in its schedulers (which then move the learning rate the sharded optimizer uses)."""
    sharded = []
    for optimizer in optimizers:
        if _is_sharded(optimizer):
            # the experiment built it sharded itself
            sharded.append(optimizer)
            continue
        zero = _wrap(optimizer)
        _replace(exp, optimizer, zero)
        for scheduler in _with_children(schedulers):
            if getattr(scheduler, "optimizer", None) is optimizer:
                scheduler.optimizer = zero
        sharded.append(zero)
    return sharded


def full_state(optimizer) -> dict:
    """The optimizer's whole state: a ZeroRedundancyOptimizer's shards gathered on rank 0 (every rank
    must call this; the other ranks get an empty dict, which they never write)."""
    if not _is_sharded(optimizer):
        return optimizer.state_dict()
    optimizer.consolidate_state_dict(to=0)
    return optimizer.state_dict() if optimizer.rank == 0 else {}


def kind(optimizer) -> str:
    """The optimizer's class, the same sharded or not: a checkpoint of one resumes the other."""
    if _is_sharded(optimizer):
        return type(optimizer.optim).__name__
    return type(optimizer).__name__


def state_bytes(optimizer) -> int:
    """Bytes of optimizer state this rank holds (a sharded optimizer's own shard)."""
    inner = optimizer.optim if _is_sharded(optimizer) else optimizer
    tensors = [t for state in inner.state.values() for t in state.values() if isinstance(t, torch.Tensor)]
    # a DTensor (dist.strategy=fsdp) counts the slice this rank holds
    return sum(local_bytes(t) for t in tensors)


def local_bytes(tensor: torch.Tensor) -> int:
    """Bytes of `tensor` this rank holds: all of a tensor, a DTensor's own slice."""
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    return local.numel() * local.element_size()


def _is_sharded(optimizer) -> bool:
    """A ZeroRedundancyOptimizer? Importing torch.distributed.optim costs each process about a second,
    so it is imported only to shard; an optimizer of that class means something imported it."""
    module = sys.modules.get("torch.distributed.optim.zero_redundancy_optimizer")
    return module is not None and isinstance(optimizer, module.ZeroRedundancyOptimizer)


def _wrap(optimizer):
    from torch.distributed.optim import ZeroRedundancyOptimizer

    cls = type(optimizer)
    name = cls.__name__
    if isinstance(optimizer, torch.optim.LBFGS):
        raise ConfigError(
            f"dist.shard_optimizer cannot shard {name}: its step treats all parameters as one vector, and each "
            "rank would see only its own part of it",
            "use dist.shard_optimizer=false with LBFGS",
        )
    # each shard's optimizer is made as cls(groups, **defaults): only what the constructor takes (AdamW's
    # defaults hold decoupled_weight_decay, which it sets itself); every setting travels in the groups
    accepted = inspect.signature(cls).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in accepted.values())
    defaults = {key: value for key, value in optimizer.defaults.items() if takes_any or key in accepted}
    groups = [dict(group) for group in optimizer.param_groups]
    try:
        zero = ZeroRedundancyOptimizer(groups, optimizer_class=cls, **defaults)
    except (ValueError, TypeError, RuntimeError) as e:
        raise ConfigError(
            f"dist.shard_optimizer cannot shard {name}: {str(e).splitlines()[0]}",
            "use dist.shard_optimizer=false for this optimizer",
        ) from None
    _track_steps(zero)
    return zero


def _track_steps(zero) -> None:
    """A learning-rate scheduler marks its optimizer's step() when it is made, and warns on its first
    step() when the step it finds is unmarked (pytorch#20124); the schedulers now step this optimizer,
    so it gets the same mark."""
    step = zero.step

    @functools.wraps(step)
    def marked_step(*args, **kwargs):
        zero._opt_called = True
        return step(*args, **kwargs)

    marked_step._wrapped_by_lr_sched = True
    zero.step = marked_step


def _replace(exp, old, new) -> None:
    """`new` wherever the experiment holds `old`: an attribute, or an item of a list or tuple."""
    for attribute, value in list(vars(exp).items()):
        if value is old:
            setattr(exp, attribute, new)
        elif isinstance(value, list):
            value[:] = [new if item is old else item for item in value]
        elif isinstance(value, tuple) and any(item is old for item in value):
            setattr(exp, attribute, tuple(new if item is old else item for item in value))


def _with_children(schedulers: list) -> list:
    """The schedulers, and the ones a SequentialLR or ChainedScheduler runs."""
    found = []
    for scheduler in schedulers:
        found.append(scheduler)
        found.extend(_with_children(getattr(scheduler, "_schedulers", [])))
    return found
