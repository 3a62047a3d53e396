"""Wrap the user's networks for data parallelism without changing how user code talks to them.

Wrappers fall back to the wrapped module for attributes they lack (`net.X`, never `net.module.X`). Calling
the network goes through DDP's forward, which synchronises gradients; its other methods run on the inner
module and do not: route training computation through `forward`."""

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ..config import DistConfig
from ..errors import ConfigError


class _PassThrough:
    """Mixin: unknown attributes come from the wrapped module."""

    def __getattr__(self, name: str):
        try:
            # parameters, buffers, submodules of the wrapper itself
            return super().__getattr__(name)
        except AttributeError:
            return getattr(super().__getattr__("module"), name)


class DDP(_PassThrough, DistributedDataParallel):
    """DistributedDataParallel whose unknown attributes are the user's network's attributes."""


class DP(_PassThrough, nn.DataParallel):
    """nn.DataParallel (one process, several GPUs; legacy) with the same attribute pass-through."""


def unwrap(model: nn.Module) -> nn.Module:
    """The user's network inside DDP, DP and torch.compile, whose parameter names checkpoints keep."""
    # torch.compile's OptimizedModule
    model = getattr(model, "_orig_mod", model)
    return unwrap(model.module) if isinstance(model, (DistributedDataParallel, nn.DataParallel)) else model


def has_trainable_parameters(module: nn.Module) -> bool:
    return any(p.requires_grad for p in module.parameters())


def wrap(model: nn.Module, cfg: DistConfig, device: torch.device, distributed: bool) -> nn.Module:
    """Wrap one network as `dist.strategy` says (ddp | dp | none)."""
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
    return DDP(
        model,
        device_ids=[device.index] if on_gpu else None,
        output_device=device.index if on_gpu else None,
        bucket_cap_mb=cfg.bucket_cap_mb,
        find_unused_parameters=cfg.find_unused_parameters,
        static_graph=cfg.static_graph,
        gradient_as_bucket_view=cfg.gradient_as_bucket_view,
    )


def compile_network(model: nn.Module, mode: str, device: torch.device) -> nn.Module:
    """trainer.compile: torch.compile over the DDP wrapper, as PyTorch advises (DDP's optimizer splits
    the graph at bucket boundaries, so the gradient all_reduce still overlaps the backward)."""
    from torch._dynamo.eval_frame import check_if_dynamo_supported
    from torch._inductor.cpp_builder import get_cpp_compiler
    from torch.utils._triton import has_triton

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
            f"trainer.compile={mode.lower()} cannot run here: {str(e).splitlines()[0]}",
            "set trainer.compile=false, or install what it names",
        ) from None
    return torch.compile(model, mode=None if mode.lower() in ("true", "default") else mode)


@contextmanager
def no_sync(models: list[nn.Module]) -> Iterator[None]:
    """Suspend DDP's gradient all_reduce on every wrapped model (while accumulating)."""
    with ExitStack() as stack:
        for m in (getattr(m, "_orig_mod", m) for m in models):
            # under torch.compile, its DDP
            if isinstance(m, DistributedDataParallel):
                stack.enter_context(m.no_sync())
        yield
