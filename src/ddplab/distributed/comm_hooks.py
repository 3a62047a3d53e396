"""Gradient compression (`dist.comm_hook`): DDP's own communication hooks, registered on every
wrapped network.

fp16 and bf16 halve the bytes of the gradient all_reduce (cast, all_reduce, cast back). PowerSGD
sends two thin factors of each gradient matrix instead of the matrix, and keeps state from step to
step that checkpoints hold (powersgd.py). Every hook runs on gloo and NCCL alike."""

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from ..config import DistConfig
from .powersgd import Compressor


def bf16_on_gloo(process_group, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """torch's bf16 hook, registered under another name. DDP refuses a hook named
    `bf16_compress_hook` unless torch was built with CUDA and NCCL 2.10 or later, whatever backend the
    job uses. gloo sums bfloat16 tensors (its process group adds them as floats), so on gloo that
    check refuses a hook that works (docs/decisions.md)."""
    return default_hooks.bf16_compress_hook(process_group, bucket)


def stateless_hook(hook: str, backend: str) -> Callable:
    """The cast-and-all_reduce hook for dist.comm_hook=fp16 or bf16 on this backend."""
    if hook == "bf16":
        return bf16_on_gloo if backend == "gloo" else default_hooks.bf16_compress_hook
    return default_hooks.fp16_compress_hook


def register(networks: dict[str, nn.Module], cfg: DistConfig, backend: str) -> dict[str, Compressor]:
    """Register dist.comm_hook on each DDP-wrapped network (under torch.compile too); returns
    PowerSGD's state of each network by name (empty for the stateless hooks)."""
    states = {}
    if cfg.comm_hook == "none":
        return states
    for name, network in networks.items():
        ddp = getattr(network, "_orig_mod", network)
        if not isinstance(ddp, DistributedDataParallel):
            continue
        if cfg.comm_hook == "powersgd":
            _fix_buckets(ddp)
            states[name] = Compressor(list(ddp.module.parameters()), cfg, one_bucket_at_a_time=backend != "nccl")
            ddp.register_comm_hook(states[name], Compressor.hook)
        else:
            ddp.register_comm_hook(None, stateless_hook(cfg.comm_hook, backend))
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
