"""The networks, optimizers and schedulers that an experiment's `build()` made, found and put in place."""

from collections.abc import Callable

import torch
from torch import nn

from ..distributed import comm_hooks, sharding
from ..distributed.wrapping import has_trainable_parameters, unwrap
from ..errors import ConfigError


def collect(exp, device: torch.device, wrap: Callable[[nn.Module], nn.Module] | None) -> tuple[dict, list, list]:
    """(networks by attribute name, unwrapped; optimizers; schedulers) among `exp`'s attributes.
    Every module (torchmetrics metrics too) is moved to the device, and each trainable network is
    replaced on `exp` by `wrap(network)` when a wrapper is given."""
    models = {}
    optimizers = []
    schedulers = []
    for name, value in list(vars(exp).items()):
        if isinstance(value, nn.Module):
            value.to(device)
            # move, never wrap
            metric = any(c.__module__.startswith("torchmetrics") for c in type(value).__mro__)
            if has_trainable_parameters(value) and not metric:
                if wrap is not None:
                    value = wrap(value)
                    setattr(exp, name, value)
                # after wrapping, which may convert its layers (SyncBatchNorm); compiled in build():
                # its checkpoints keep the plain names
                models[name] = unwrap(value)
        else:
            # an optimizer or scheduler, or a list of them (one per replicate network)
            for item in value if isinstance(value, (list, tuple)) else [value]:
                if isinstance(item, torch.optim.Optimizer):
                    optimizers.append(item)
                elif isinstance(item, torch.optim.lr_scheduler.LRScheduler):
                    schedulers.append(item)
    if not models or not optimizers:
        raise ConfigError(
            f"{type(exp).__name__}.build() made no trainable network or no optimizer",
            "assign them to attributes of self, e.g. self.net = Net(); self.opt = AdamW(...)",
        )
    check_everything_trained_is_seen(exp, models, optimizers)
    return models, optimizers, schedulers


def apply_levers(exp, models: dict[str, nn.Module], optimizers: list, schedulers: list) -> tuple[list, dict]:
    """dist.shard_optimizer and dist.comm_hook on a job of several ranks, once `models` are wrapped:
    (the optimizers, sharded when asked; PowerSGD's state of each network). One process has no ranks
    to shard across or to send gradients to, so they stay off there."""
    cfg = exp.cfg.dist
    rt = exp.rt
    if not rt.distributed:
        return optimizers, {}
    if cfg.shard_optimizer:
        optimizers = sharding.shard(exp, optimizers, schedulers)
    networks = {name: getattr(exp, name) for name in models}
    return optimizers, comm_hooks.register(networks, cfg, rt.backend)


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
