"""Wrap the user's networks for data parallelism without changing how user code talks to them.

Wrappers fall back to the wrapped module for attributes they lack (`net.X`, never `net.module.X`). Calling
the network goes through DDP's forward, which synchronises gradients; its other methods run on the inner
module and do not: route training computation through `forward`."""

import inspect
import re
import sys
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ..config import DistConfig
from ..config_rules import switch_value
from ..errors import ConfigError
from . import fsdp
from .console import print0

# DDP's own bucket size when it is given none, in MiB
DDP_BUCKET_CAP_MB = 25.0

# dist.broadcast_buffers: torch 2.13 renamed DDP's switch (the new one still copies rank 0's buffers
# once at construction, which changes nothing here: build() makes the same network on every rank)
if "forward_sync_buffers" in inspect.signature(DistributedDataParallel).parameters:
    BUFFER_SYNC = "forward_sync_buffers"
else:
    BUFFER_SYNC = "broadcast_buffers"


class PassThrough:
    """Mixin: unknown attributes come from the wrapped module."""

    def __getattr__(self, name: str):
        try:
            # parameters, buffers, submodules of the wrapper itself
            return super().__getattr__(name)
        except AttributeError:
            return getattr(super().__getattr__("module"), name)


class DDP(PassThrough, DistributedDataParallel):
    """DistributedDataParallel whose unknown attributes are the user's network's attributes."""


class DP(PassThrough, nn.DataParallel):
    """nn.DataParallel (one process, several GPUs; legacy) with the same attribute pass-through."""


def unwrap(model: nn.Module) -> nn.Module:
    """The user's network inside DDP, DP and torch.compile, whose parameter names checkpoints keep."""
    # torch.compile's OptimizedModule
    model = getattr(model, "_orig_mod", model)
    return unwrap(model.module) if isinstance(model, (DistributedDataParallel, nn.DataParallel)) else model


def has_trainable_parameters(module: nn.Module) -> bool:
    return any(p.requires_grad for p in module.parameters())


def wrap(
    model: nn.Module,
    cfg: DistConfig,
    device: torch.device,
    distributed: bool,
    buffers_in_forward: bool = True,
    precision: str = "fp32",
) -> nn.Module:
    """Wrap one network as `dist.strategy` says (ddp | fsdp | dp | none). buffers_in_forward=False: DDP
    does not copy rank 0's buffers before each forward (a collective); the caller does it elsewhere.
    One process has no ranks to synchronize or shard across: the network stays as it is."""
    if cfg.strategy == "none" or not has_trainable_parameters(model):
        return model
    if cfg.strategy == "dp":
        # several processes would each train their own copy, never synchronized
        if distributed:
            raise ConfigError(
                "dist.strategy=dp runs one process over all GPUs, and this job has several processes",
                "start 1 process (-n 1) or use dist.strategy=ddp",
            )
        if device.type != "cuda" or torch.cuda.device_count() < 2:
            return model
        return DP(model)
    if not distributed:
        return model
    if dist.get_debug_level() == dist.DebugLevel.DETAIL:
        # seen with torch 2.13: a crash in DDP's constructor
        raise ConfigError(
            "dist.debug=detail crashes inside DistributedDataParallel with this torch",
            "use dist.debug=info with DDP; detail checks plain collectives (e.g. with dist.strategy=none)",
        )
    on_gpu = device.type == "cuda"
    if cfg.strategy == "fsdp":
        _warn_of_batchnorm(model, on_gpu)
        _note_dropout(model)
        return fsdp.shard(model, cfg, device, precision)
    if cfg.sync_batchnorm:
        check_sync_batchnorm(device.type)
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    else:
        _warn_of_batchnorm(model, on_gpu)
    _note_dropout(model)
    return DDP(
        model,
        device_ids=[device.index] if on_gpu else None,
        output_device=device.index if on_gpu else None,
        **{BUFFER_SYNC: cfg.broadcast_buffers and buffers_in_forward},
        bucket_cap_mb=_bucket_cap_mb(cfg),
        find_unused_parameters=cfg.find_unused_parameters,
        static_graph=cfg.static_graph,
        gradient_as_bucket_view=cfg.gradient_as_bucket_view,
    )


def _bucket_cap_mb(cfg: DistConfig) -> float | None:
    """dist.bucket_cap_mb as DDP is to get it: unset leaves DDP its small first bucket, which starts
    the all_reduce while the backward goes on. Not under PowerSGD: its buckets are laid out once in
    parameter order (comm_hooks.py), where the first holds the first layer, whose gradient comes
    last, and a bucket more is one more round of compression (measured slower, 34 ms against 33)."""
    if cfg.bucket_cap_mb is None and cfg.comm_hook == "powersgd":
        return DDP_BUCKET_CAP_MB
    return cfg.bucket_cap_mb


def unused_parameters(error: RuntimeError, networks: list[nn.Module]) -> ConfigError | None:
    """DDP's error for parameters that got no gradient in a step (a head used on some steps only, a
    branch the loss skips) without dist.find_unused_parameters, or that under dist.static_graph got
    one after a first step without, as one line naming them; None for any other error. DDP reports
    unused ones by index among the parameters it reduces."""
    text = str(error)
    if "Your training graph has changed in this iteration" in text:
        # the other way round: a parameter the first step left unused takes part in a later one
        return ConfigError(
            "a parameter that got no gradient in the first step got one in this step, and dist.static_graph=true "
            "told DDP that every step uses the same parameters",
            "set dist.static_graph=false (and dist.find_unused_parameters=true) for a graph that changes between steps",
        )
    if "Expected to have finished reduction in the prior iteration" not in text:
        return None
    found = re.search(r"did not receive grad for rank (\d+): ([\d ]+)", text)
    inner = (getattr(net, "_orig_mod", net) for net in networks)
    ddps = [net for net in inner if isinstance(net, DistributedDataParallel)]
    # DDP counts the parameters it reduces: those it was told to ignore (a module networks share) are not
    reduced = [
        [name for name, p in unwrap(net).named_parameters() if p.requires_grad and name not in net.parameters_to_ignore]
        for net in ddps
    ]
    which = "some parameters"
    if found and len(reduced) == 1:
        names = [reduced[0][int(i)] for i in found.group(2).split() if int(i) < len(reduced[0])]
        which = f"{', '.join(names[:6])}{' ...' if len(names) > 6 else ''} (on rank {found.group(1)})"
    if any(getattr(net, "static_graph", False) for net in ddps):
        return ConfigError(
            f"{which} received no gradient in the last step, and dist.static_graph=true told DDP that every step "
            "uses the same parameters",
            "set dist.static_graph=false (and dist.find_unused_parameters=true) for a graph that changes between steps",
        )
    return ConfigError(
        f"{which} received no gradient in the last step: DDP waits for every parameter's gradient "
        "unless told that some may be unused",
        "set dist.find_unused_parameters=true (DDP then looks for them each step, at some cost), or make every "
        "parameter take part in each step's loss",
    )


def sync_buffers(networks: list[nn.Module]) -> None:
    """Rank 0's buffers (BatchNorm's running statistics) on every rank, as DDP copies them before each
    training forward (dist.broadcast_buffers). Evaluation runs on the bare network, after a training
    forward in which each rank updated its own: without this, each rank would evaluate its part of
    the data with other statistics than the ones rank 0 saves and exports."""
    for network in networks:
        ddp = getattr(network, "_orig_mod", network)
        # FSDP2 leaves buffers whole on every rank, and never copies them
        if isinstance(ddp, DistributedDataParallel) or fsdp.is_sharded(ddp):
            for buffer in unwrap(ddp).buffers():
                dist.broadcast(buffer, src=0)


def check_levers(cfg: DistConfig, backend: str, world_size: int) -> None:
    """DDP's levers this job's backend cannot run, refused before any worker starts."""
    if world_size > 1 and cfg.sync_batchnorm:
        check_sync_batchnorm("cuda" if backend == "nccl" else "cpu")


def check_sync_batchnorm(device_type: str) -> None:
    if device_type != "cuda":
        raise ConfigError(
            "dist.sync_batchnorm=true needs GPUs: torch's SyncBatchNorm runs on CUDA only, and this job trains "
            "on the CPU",
            "use dist.sync_batchnorm=false on the CPU (and keep the world size and trainer.accumulate fixed, or "
            "use GroupNorm/LayerNorm, whose results do not depend on them)",
        )


def batchnorm_layers(model: nn.Module) -> list[str]:
    """The BatchNorm layers that normalize with their own rank's micro-batch only."""
    return [
        f"{name or '(the network itself)'}: {type(module).__name__}"
        for name, module in model.named_modules()
        if isinstance(module, nn.modules.batchnorm._BatchNorm) and not isinstance(module, nn.SyncBatchNorm)
    ]


def _warn_of_batchnorm(model: nn.Module, on_gpu: bool) -> None:
    """Under DDP each rank normalizes its own micro-batch: the statistics, and so the trained model,
    change with the world size. Said once, at the start, naming the layers."""
    layers = batchnorm_layers(model)
    if not layers:
        return
    shown = _listed(layers, 4)
    if on_gpu:
        fix = "dist.sync_batchnorm=true normalizes with every rank's micro-batch"
    else:
        fix = "on the CPU (no SyncBatchNorm) keep the world size and accumulation fixed, or use GroupNorm/LayerNorm"
    print0(
        f"ddplab: warning: {type(model).__name__} has BatchNorm layers ({shown}), which compute their statistics "
        f"over each rank's own micro-batch, so the trained model depends on the world size; {fix}",
        file=sys.stderr,
    )


class RankBuffers:
    """The buffers a training step leaves different on different ranks (BatchNorm's aside, warned of at
    wrapping): a statistic that a forward updates from its own rank's micro-batch, such as a running
    mean. DDP then keeps rank 0's copy, so the trained model depends on the world size. Checked once,
    after the first step's forward and backward, with one small all_reduce on every rank."""

    def __init__(self, networks: list[nn.Module], device: torch.device):
        # where the all_reduce runs (NCCL: the GPU), whatever device a buffer is on
        self.device = device
        self.buffers = [
            (f"{name}.{key}" if name else key, buffer)
            for network in networks
            if isinstance(getattr(network, "_orig_mod", network), DistributedDataParallel)
            for name, module in unwrap(network).named_modules()
            if not isinstance(module, nn.modules.batchnorm._BatchNorm)
            for key, buffer in module._buffers.items()
            if buffer is not None and buffer.is_floating_point()
        ]

    def check(self) -> None:
        if not self.buffers:
            return
        # two fingerprints a buffer: its sum and its sum of squares, as [x, -x] under MAX: max and -min
        prints = torch.stack([_fingerprint(buffer).to(self.device) for _, buffer in self.buffers])
        both = torch.cat([prints, -prints], dim=1)
        dist.all_reduce(both, op=dist.ReduceOp.MAX)
        differ = (both[:, :2] != -both[:, 2:]).any(dim=1).tolist()
        names = [name for (name, _), apart in zip(self.buffers, differ, strict=True) if apart]
        if not names:
            return
        shown = _listed(names, 4)
        print0(
            f"ddplab: warning: the buffers {shown} changed in the first training step and differ between ranks: "
            "each rank updates them from its own micro-batch and the checkpoint keeps rank 0's, so the trained "
            "model depends on the world size; average them over the ranks where the forward updates them "
            "(torch.distributed.all_reduce), or keep the world size and accumulation fixed",
            file=sys.stderr,
        )


def _listed(names: list[str], most: int) -> str:
    """'a, b, c and 2 more': the first few names of a list a warning gives."""
    return ", ".join(names[:most]) + (f" and {len(names) - most} more" if len(names) > most else "")


def _fingerprint(buffer: torch.Tensor) -> torch.Tensor:
    values = buffer.detach().double().nan_to_num()
    return torch.stack([values.sum(), (values * values).sum()])


def dropout_layers(model: nn.Module) -> list[str]:
    """The dropout layers that drop something (p > 0), by name."""
    return [
        name or "(the network itself)"
        for name, module in model.named_modules()
        if isinstance(module, nn.modules.dropout._DropoutNd) and module.p > 0
    ]


def _note_dropout(model: nn.Module) -> None:
    """Each rank draws its own dropout masks from a stream of its own (seed and rank), so the same
    global batches see other masks on another number of ranks: the result is as good, not the same.
    Said once, beside the run's banner, where the promise of world-size independence is made."""
    layers = dropout_layers(model)
    if not layers:
        return
    shown = _listed(layers, 3)
    print0(
        f"ddplab: note: {type(model).__name__} has dropout ({shown}): each rank draws its own masks, so on another "
        "number of ranks the same global batches see other masks (a result as good, not the same bits)"
    )


def compile_network(model: nn.Module, mode: bool | str, device: torch.device) -> nn.Module:
    """trainer.compile: torch.compile over the DDP wrapper, as PyTorch advises (DDP's optimizer splits
    the graph at bucket boundaries, so the gradient all_reduce still overlaps the backward)."""
    from torch._dynamo.eval_frame import check_if_dynamo_supported
    from torch._inductor.cpp_builder import get_cpp_compiler
    from torch.utils._triton import has_triton

    mode = switch_value(mode)
    shown = str(mode).lower()

    if isinstance(model, nn.DataParallel):
        # its replicas, made on every call, would run uncompiled (pytorch#94636)
        raise ConfigError(
            "trainer.compile does not reach the replicas of dist.strategy=dp (DataParallel)",
            "use dist.strategy=ddp, one process per GPU (ddplab run -n <GPUs>), or trainer.compile=false",
        )
    try:
        check_if_dynamo_supported()
        if device.type == "cpu":
            # inductor builds C++ for the CPU
            get_cpp_compiler()
        elif device.type == "cuda" and not has_triton():
            raise RuntimeError("inductor needs Triton for CUDA, and it is not installed")
    except Exception as e:
        raise ConfigError(
            f"trainer.compile={shown} cannot run here: {str(e).splitlines()[0]}",
            "set trainer.compile=false, or install what it names",
        ) from None
    # true is torch's default mode
    return torch.compile(model, mode=None if mode in (True, "default") else mode)


@contextmanager
def no_sync(models: list[nn.Module]) -> Iterator[None]:
    """Suspend DDP's gradient all_reduce, and FSDP's reduce-scatter, on every wrapped model (while
    accumulating)."""
    with ExitStack() as stack:
        for m in (getattr(m, "_orig_mod", m) for m in models):
            # under torch.compile, its DDP
            if isinstance(m, DistributedDataParallel):
                stack.enter_context(m.no_sync())
        stack.enter_context(fsdp.gradient_sync(models, on=False))
        yield
