"""The networks, optimizers and schedulers that an experiment's `build()` made, found and put in place."""

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn.parameter import is_lazy

from ..distributed import comm_hooks, fsdp, gradients, sharding
from ..distributed.gradients import SharedParameters
from ..distributed.wrapping import has_trainable_parameters, unwrap
from ..errors import ConfigError
from .precision import Precision


@dataclass
class TrainingParts:
    """What the experiment's build() made, found and put in place (Trainer.build): handed as one to
    the step, checkpoints, evaluation, inference and export."""

    # build()'s networks by attribute name, unwrapped: what checkpoints and final/ hold
    models: dict[str, nn.Module]
    # the same networks as training calls them (wrapped for DDP, maybe compiled), in the same order
    networks: list[nn.Module]
    optimizers: list[torch.optim.Optimizer]
    schedulers: list
    precision: Precision
    # dist.comm_hook=powersgd: each network's PowerSGD state, by name
    hook_states: dict
    # the parameters several networks hold, averaged after each step's last backward
    shared: SharedParameters


def collect(
    exp, device: torch.device, wrap: Callable[[nn.Module], nn.Module] | None
) -> tuple[dict, list, list, SharedParameters]:
    """(networks by attribute name, unwrapped; optimizers; schedulers; the parameters several
    networks share) among `exp`'s attributes. Every module (torchmetrics metrics too) is moved to
    the device, and each trainable network is replaced on `exp` by `wrap(network)` when a wrapper
    is given."""
    models = {}
    optimizers = []
    schedulers = []
    trainable = {}
    for name, value in list(vars(exp).items()):
        if isinstance(value, nn.Module):
            value.to(device)
            # move, never wrap
            metric = any(c.__module__.startswith("torchmetrics") for c in type(value).__mro__)
            if has_trainable_parameters(value) and not metric:
                trainable[name] = value
        else:
            # an optimizer or scheduler, or a list of them (one per replicate network)
            for item in value if isinstance(value, (list, tuple)) else [value]:
                if isinstance(item, torch.optim.Optimizer):
                    optimizers.append(item)
                elif isinstance(item, torch.optim.lr_scheduler.LRScheduler):
                    schedulers.append(item)
    # a module two networks hold is synchronized by neither wrapper (distributed/gradients.py)
    shared = SharedParameters(list(trainable.values()))
    # parameters a wrapper replaced (FSDP2 shards them into new ones): the optimizers follow
    moved: dict[int, torch.Tensor] = {}
    for name, value in trainable.items():
        shared.leave_to_ddp(value)
        if wrap is not None:
            places = fsdp.parameter_places(value)
            value = wrap(value)
            moved.update(fsdp.replaced(places))
            setattr(exp, name, value)
        # after wrapping, which may convert its layers (SyncBatchNorm); compiled in build():
        # its checkpoints keep the plain names
        models[name] = unwrap(value)
    fsdp.retarget(optimizers, moved)
    if not models or not optimizers:
        raise ConfigError(
            f"{type(exp).__name__}.build() made no trainable network or no optimizer",
            "assign them to attributes of self, e.g. self.net = Net(); self.opt = AdamW(...)",
        )
    check_everything_trained_is_seen(exp, models, optimizers)
    return models, optimizers, schedulers, shared


@torch.no_grad()
def shape_lazy_parameters(exp, first_batch: Callable[[], object]) -> None:
    """Lazily made parameters (nn.LazyLinear) take their shapes from a first forward, and DDP, the
    optimizer's state and checkpoints need them made. One training_step on a first batch, as
    torch's docs advise (a dry run), makes them before anything else sees the networks: in eval
    mode and without gradients, so no statistic moves; right after build(), whose seed draws the
    same values on every rank. What it logs is dropped."""
    networks = [value for value in vars(exp).values() if isinstance(value, nn.Module) and _has_lazy(value)]
    if not networks:
        return
    for network in networks:
        network.to(exp.device).eval()
    exp.training_step(first_batch())
    for network in networks:
        network.train()
    exp.trainer.metrics.take()
    still = [name for name, value in vars(exp).items() if isinstance(value, nn.Module) and _has_lazy(value)]
    if still:
        raise ConfigError(
            f"{type(exp).__name__}.{still[0]} still has lazily made parameters after one training_step: "
            "training_step does not call them",
            "call every lazy module in training_step, or give it its input size (nn.Linear for nn.LazyLinear)",
        )


def _has_lazy(module: nn.Module) -> bool:
    return any(is_lazy(p) for p in module.parameters())


def apply_levers(exp, models: dict[str, nn.Module], optimizers: list, schedulers: list) -> tuple[list, dict]:
    """dist.shard_optimizer and dist.comm_hook on a job of several ranks, once `models` are wrapped,
    and with dist.strategy=fsdp the check that the units it names exist. Returns (the optimizers,
    sharded when asked; PowerSGD's state of each network). One process has no ranks to shard across
    or to send gradients to, so they stay off there."""
    cfg = exp.cfg.dist
    rt = exp.rt
    if not rt.distributed:
        return optimizers, {}
    if cfg.strategy == "fsdp":
        fsdp.check_named_units(models, cfg.fsdp_units)
    if cfg.shard_optimizer:
        optimizers = sharding.shard(exp, optimizers, schedulers)
    networks = {name: getattr(exp, name) for name in models}
    return optimizers, comm_hooks.register(networks, cfg, rt.backend)


def shared_mean(cfg, rt) -> Callable[[torch.Tensor], None] | None:
    """How the gradients of what networks share are averaged: over the ranks when DDP synchronizes
    the networks; not at all in one process or with networks left unwrapped. FSDP refuses a module
    two networks share (distributed/fsdp.py); a live replica averages over its quorum (train/live.py)."""
    if rt.distributed and cfg.strategy == "ddp":
        return gradients.mean_over_ranks(rt.world_size)
    return None


def check_everything_trained_is_seen(exp, models: dict[str, nn.Module], optimizers: list) -> None:
    """DDP synchronizes, and checkpoints hold, only the networks found as attributes of the
    experiment. A parameter that an optimizer trains outside them would differ between ranks and
    be lost at a resume: refused in one line that names where it is."""
    name = type(exp).__name__
    for attribute, value in vars(exp).items():
        held = _networks_in(value)
        if held and not isinstance(value, nn.Module):
            raise ConfigError(
                f"{name}.{attribute} holds networks in a {type(value).__name__}: ddplab synchronizes and saves "
                "networks only as attributes of the experiment, so these would train unsynchronized and unsaved",
                f"give each network its own attribute (self.{attribute}_0 = ...), or put them in one nn.Module",
            )
    seen = {id(p) for model in models.values() for p in model.parameters()}
    for opt in optimizers:
        for group in opt.param_groups:
            for param in group["params"]:
                if param.requires_grad and id(param) not in seen:
                    where = _attribute_of(exp, param) or f"a parameter of shape {tuple(param.shape)}"
                    raise ConfigError(
                        f"{type(opt).__name__} trains {where}, which is in none of {name}'s networks: DDP would "
                        "not synchronize it and checkpoints would not hold it",
                        "make it part of a network (an nn.Module attribute of the experiment, e.g. "
                        "self.net.scale = nn.Parameter(...))",
                    )


def _networks_in(value) -> list[nn.Module]:
    """The trainable networks in a list, tuple or dict (one level deep)."""
    if isinstance(value, dict):
        value = list(value.values())
    if not isinstance(value, (list, tuple)):
        return []
    return [item for item in value if isinstance(item, nn.Module) and has_trainable_parameters(item)]


def _attribute_of(exp, param: torch.Tensor) -> str | None:
    for attribute, value in vars(exp).items():
        if value is param:
            return f"{type(exp).__name__}.{attribute}"
    return None
