"""One optimizer step: micro-batches with gradient accumulation, mixed precision, clipping.

The rules live here and nowhere else: DDP's all_reduce runs only on the last micro-batch (`no_sync` on
the others); each micro-batch's loss is divided by their number, so the accumulated gradient is the
mean over the global batch; gradients are unscaled before they are clipped or checked; schedulers step
once per step."""

import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn.utils import clip_grad_norm_

from ..distributed import fsdp
from ..distributed.gradients import SharedParameters
from ..distributed.wrapping import RankBuffers, no_sync, unused_parameters
from ..errors import ConfigError
from .intervals import LogIntervals
from .metrics import MetricTracker
from .nonfinite import NonFiniteGuard
from .precision import NO_CONTEXT, Precision
from .progress import TrainProgress
from .returns import split_output


@dataclass
class StepParts:
    """What trains in a step, gathered once when training starts."""

    # the experiment: training_step, count_tokens and print
    experiment: object
    # the networks as training calls them (wrapped for DDP, maybe compiled)
    networks: list[nn.Module]
    optimizers: list[torch.optim.Optimizer]
    schedulers: list
    precision: Precision
    grad_clip: float
    skip_nonfinite: bool
    # the parameters several networks hold, which no DDP wrapper synchronizes
    shared: SharedParameters | None = None
    # distributed.wrapping.RankBuffers, checked after the first step's micro-batches
    rank_buffers: RankBuffers | None = None
    # this process's first step, which checks what later steps take for granted
    first_step: bool = True


@dataclass
class StepRecords:
    """Where a step reports: its losses and timings, its logged values, its non-finite check; progress
    only to name the step under way (the loop advances it)."""

    interval: LogIntervals
    metrics: MetricTracker
    nonfinite: NonFiniteGuard
    progress: TrainProgress


def optimizer_step(parts: StepParts, records: StepRecords, batches: Iterator, accumulate: int):
    """Take `accumulate` micro-batches from `batches` and make one optimizer step of them."""
    for micro in range(accumulate):
        micro_batch(parts, records, batches, last=micro == accumulate - 1, accumulate=accumulate)
    check_rank_buffers(parts)
    apply_gradients(parts, records)


def check_rank_buffers(parts: StepParts) -> None:
    """Once, after the first step's micro-batches: buffers the forward left different on each rank."""
    if parts.first_step and parts.rank_buffers is not None:
        parts.rank_buffers.check()


def apply_gradients(parts: StepParts, records: StepRecords) -> None:
    """The optimizer step of gradients accumulated over the global batch: unscale, clip, check, step."""
    # fp16: true gradients before clipping or checking
    if parts.precision.scaler:
        for opt in parts.optimizers:
            parts.precision.scaler.unscale_(opt)
    if parts.grad_clip:
        # all networks together; the logged norm is the one before clipping
        # a parameter two networks share counts once
        params = list({id(p): p for net in parts.networks for p in net.parameters() if p.grad is not None}.values())
        # sharded gradients (dist.strategy=fsdp): the norm over every rank's shards
        clip = fsdp.total_norm if any(fsdp.is_sharded(net) for net in parts.networks) else clip_grad_norm_
        records.metrics.add("grad_norm", clip(params, parts.grad_clip))
    if parts.skip_nonfinite and not records.nonfinite.gradients_finite(parts.networks):
        parts.precision.skip()
        records.metrics.add("skipped", 1.0)
        parts.experiment.print(
            f"step {records.progress.step + 1}: gradients are not finite, optimizer step skipped "
            "(trainer.nonfinite=skip)"
        )
    else:
        parts.precision.step(parts.optimizers)
        if parts.skip_nonfinite:
            records.metrics.add("skipped", 0.0)
    for opt in parts.optimizers:
        # set_to_none, torch's default
        opt.zero_grad()
    for scheduler in parts.schedulers:
        scheduler.step()
    parts.first_step = False


def micro_batch(
    parts: StepParts, records: StepRecords, batches: Iterator, last: bool, accumulate: int, weight: float | None = None
) -> None:
    """Forward and backward of one micro-batch; DDP's gradient all_reduce only on the last. Its loss
    counts 1/accumulate of the step's, or `weight` (micro-batches of unequal sizes: train/live.py)."""
    waited = time.perf_counter()
    # on the device already (sources.py)
    batch = next(batches)
    records.interval.waited(time.perf_counter() - waited)
    tokens = parts.experiment.count_tokens(batch)
    if tokens is not None:
        # an int, or a tensor summed on its device
        records.interval.tokens += tokens
    with NO_CONTEXT if last else no_sync(parts.networks):
        # the forward: what tells a slow rank (stragglers.py)
        records.interval.forward.start()
        with parts.precision.autocast(), training_forward(parts.networks, parts.first_step):
            loss, extra = split_output(parts.experiment.training_step(batch))
        records.interval.forward.stop()
        # a mean over the global batch (a loss is not divided by 1: one op less, bitwise the same)
        with ddp_mistakes(parts.networks):
            if weight is not None:
                parts.precision.backward(loss * weight)
            else:
                parts.precision.backward(loss / accumulate if accumulate > 1 else loss)
    if last and parts.shared is not None:
        # the step's gradients are whole: what DDP did for the rest, for what networks share
        parts.shared.synchronize()
    records.interval.keep_loss(loss.detach())
    for key, value in extra.items():
        records.metrics.add(key, value)


# torch.utils.checkpoint's warning when a reentrant checkpoint's inputs need no gradient
NO_INPUT_GRAD = "None of the inputs have requires_grad=True"


@contextmanager
def ddp_mistakes(networks: list[nn.Module]):
    """A backward in which DDP finds a mistake of the experiment's (under dist.static_graph, a
    parameter that the first step left unused takes part): one line, not DDP's traceback."""
    try:
        yield
    except RuntimeError as e:
        _raise_ddp_mistake(e, networks)
        raise


def _raise_ddp_mistake(error: RuntimeError, networks: list[nn.Module]) -> None:
    if (mistake := unused_parameters(error, networks)) is not None:
        raise mistake from None


@contextmanager
def training_forward(networks: list[nn.Module], first_step: bool):
    """A training forward, with two mistakes that surface in it as one line each: DDP's parameters
    that got no gradient in the step before, and a reentrant gradient checkpoint whose inputs need
    no gradient. torch only warns of the second, and the parameters inside it then silently get no
    gradient: the run trains without them on one rank, and DDP blames unused parameters on more.
    That warning is an error in the first step only: changing the warning filters makes Python show
    again, once, each warning it had shown once already."""
    with warnings.catch_warnings() if first_step else NO_CONTEXT:
        if first_step:
            warnings.filterwarnings("error", message=NO_INPUT_GRAD, category=UserWarning)
        try:
            yield
        except UserWarning as e:
            if NO_INPUT_GRAD not in str(e):
                raise
            raise ConfigError(
                "a gradient checkpoint with use_reentrant=True (torch.utils.checkpoint) got inputs of which none "
                "needs a gradient, so the parameters inside it would get no gradient and never train",
                "pass use_reentrant=False to torch.utils.checkpoint.checkpoint (torch's advice), or checkpoint a "
                "part whose input needs a gradient",
            ) from None
        except RuntimeError as e:
            # the DDP mistake that surfaces a step later (unused parameters)
            _raise_ddp_mistake(e, networks)
            raise
