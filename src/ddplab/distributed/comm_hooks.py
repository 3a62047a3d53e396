"""Gradient compression (`dist.comm_hook`): DDP's own communication hooks, registered on every
wrapped network.

fp16 and bf16 halve the bytes of the gradient all_reduce (cast, all_reduce, cast back; bf16 runs on
NCCL only). PowerSGD sends two thin factors of each gradient matrix instead of the matrix, and keeps
state from step to step that checkpoints hold (powersgd.py)."""

from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from ..config import DistConfig
from ..errors import ConfigError
from .powersgd import Compressor

STATELESS = {"fp16": default_hooks.fp16_compress_hook, "bf16": default_hooks.bf16_compress_hook}
# the hooks that cast to a 16-bit type before the all_reduce, and the backends that can sum that type
NEEDS = {"bf16": ("nccl",)}


def check_backend(hook: str, backend: str) -> None:
    """A hook the backend cannot run, refused before any worker starts (the launcher) or before the
    first step (a worker started another way)."""
    if backend not in NEEDS.get(hook, (backend,)):
        raise ConfigError(
            f"dist.comm_hook={hook} needs the {' or '.join(NEEDS[hook])} backend, and this job uses {backend} "
            f"({backend} cannot sum {hook} tensors)",
            "use dist.comm_hook=fp16 or dist.comm_hook=powersgd, which run on every backend",
        )


def register(networks: dict[str, nn.Module], cfg: DistConfig, backend: str) -> dict[str, Compressor]:
    """Register dist.comm_hook on each DDP-wrapped network (under torch.compile too); returns
    PowerSGD's state of each network by name (empty for the stateless hooks)."""
    states = {}
    if cfg.comm_hook == "none":
        return states
    check_backend(cfg.comm_hook, backend)
    for name, network in networks.items():
        ddp = getattr(network, "_orig_mod", network)
        if not isinstance(ddp, DistributedDataParallel):
            continue
        if cfg.comm_hook == "powersgd":
            _fix_buckets(ddp)
            states[name] = Compressor(list(ddp.module.parameters()), cfg, one_bucket_at_a_time=backend != "nccl")
            ddp.register_comm_hook(states[name], Compressor.hook)
        else:
            ddp.register_comm_hook(None, STATELESS[cfg.comm_hook])
    return states


def _fix_buckets(ddp: DistributedDataParallel) -> None:
    """Lay out DDP's gradient buckets now, in parameter order, for the whole run. DDP would start
    with one bucket and re-lay them out in the order gradients became ready after the first step;
    PowerSGD's arithmetic (its matrix products) depends on where each gradient lies in its bucket, so
    a resumed run, at its first step in the first layout, would compute what the killed run computed
    in the second layout with different rounding. One fixed layout makes every run compute the same.
    The cost: DDP can start the first bucket's all_reduce only when the first layer's gradient is
    ready, at the end of the backward (gloo loses nothing: PowerSGD on gloo runs one bucket at a time
    anyway)."""
    ddp.reducer._push_all_rebuilt_params()
    ddp.reducer._rebuild_buckets()
