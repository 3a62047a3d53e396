"""The networks, optimizers and schedulers that an experiment's `build()` made, found and put in place."""

from collections.abc import Callable

import torch
from torch import nn

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
                # compiled in build(): its checkpoints keep the plain names
                models[name] = unwrap(value)
                if wrap is not None:
                    setattr(exp, name, wrap(value))
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
    return models, optimizers, schedulers
