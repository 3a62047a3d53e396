"""Gradients that ddplab averages over the ranks itself, where no DDP wrapper does it for the step.

A parameter that several networks hold (a trunk shared by two heads, a GAN-like pair, an encoder's
and a decoder's embedding) cannot be left to DDP: each network is wrapped on its own, two wrappers
of one parameter would each reduce its gradient, and one wrapper alone reduces it only in the steps
where that network is called, so a step that trains the trunk through the other network leaves it
unsynchronized and the ranks drift apart. Every wrapper ignores such a parameter, and its gradient
is averaged here once per optimizer step, after the last micro-batch's backward, whichever network
the step called. trainer.oom_backoff sums every gradient here too (its pieces run without DDP's sync).
"""

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

# the most bytes one all_reduce of gradients carries: DDP's own bucket size
BUCKET_BYTES = 25 * 2**20


def mean_over_ranks(world_size: int) -> Callable[[torch.Tensor], None]:
    """A tensor made, in place, the mean of every rank's in the default process group, as DDP computes
    it (divide, then sum)."""

    def mean(tensor: torch.Tensor) -> None:
        dist.all_reduce(tensor.div_(world_size))

    return mean


def average(params: list[torch.Tensor], mean: Callable[[torch.Tensor], None]) -> None:
    """Each parameter's gradient becomes the mean of every rank's, `mean` making a tensor the mean
    over the ranks in place (mean_over_ranks, or a live replica's quorum), in buckets. A parameter no
    rank used in the step keeps no gradient, as DDP and a single process leave it (a zero one would
    still move it: weight decay, momentum); one that some rank used takes part with zeros from the
    others."""
    # a parameter listed twice (two networks hold it) is reduced once
    params = list({id(p): p for p in params if p.requires_grad}.values())
    if not params:
        return
    used = torch.tensor([p.grad is not None for p in params], dtype=torch.float32, device=params[0].device)
    mean(used)
    params = [p for p, anywhere in zip(params, used.tolist(), strict=True) if anywhere > 0]
    for p in params:
        if p.grad is None:
            # a parameter this rank did not use, another did: it still takes part in the sum
            p.grad = torch.zeros_like(p)
    bucket, size = [], 0
    for p in [*params, None]:
        if p is not None and (not bucket or (p.grad.dtype == bucket[0].dtype and size < BUCKET_BYTES)):
            bucket.append(p.grad)
            size += p.grad.numel() * p.grad.element_size()
            continue
        if bucket:
            flat = torch.cat([g.reshape(-1) for g in bucket])
            mean(flat)
            offset = 0
            for g in bucket:
                g.copy_(flat[offset : offset + g.numel()].view_as(g))
                offset += g.numel()
        if p is not None:
            bucket, size = [p.grad], p.grad.numel() * p.grad.element_size()


class SharedParameters:
    """The parameters that more than one network holds, taken from every DDP wrapper and averaged
    here (module docstring). Buffers stay with the first network that holds them: DDP copies rank
    0's buffers in that network's forward, and a copy more would change nothing."""

    def __init__(self, networks: list[nn.Module]):
        owners: dict[int, int] = {}
        for network in networks:
            for p in {id(p): p for p in network.parameters()}.values():
                owners[id(p)] = owners.get(id(p), 0) + 1
        self.ids = {key for key, count in owners.items() if count > 1}
        self.params = list({id(p): p for n in networks for p in n.parameters() if id(p) in self.ids}.values())
        self._buffers_seen: set[int] = set()
        # the mean over the ranks (or a live replica's quorum) when they are synchronized; None: never
        # (one process, or networks left unwrapped)
        self.mean: Callable[[torch.Tensor], None] | None = None

    def __bool__(self) -> bool:
        return bool(self.params)

    def leave_to_ddp(self, network: nn.Module) -> None:
        """Before `network` is wrapped: its shared parameters, and the buffers a network wrapped
        before it holds, are not DDP's to synchronize."""
        ignored = [name for name, p in network.named_parameters(remove_duplicate=False) if id(p) in self.ids]
        ignored += [name for name, b in network.named_buffers() if id(b) in self._buffers_seen]
        if ignored:
            DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(network, ignored)
        self._buffers_seen.update(id(b) for b in network.buffers())

    def synchronize(self) -> None:
        """After the step's last backward, on every rank: the shared gradients averaged."""
        if self.params and self.mean is not None:
            average(self.params, self.mean)
