"""What to do when the loss or the gradients stop being finite numbers (`trainer.nonfinite`)."""

import torch
from torch import nn

from ..distributed import collectives
from ..errors import ConfigError
from .metrics import FOLD, on_device


class NonFiniteGuard:
    """error (default): each micro-batch's loss is kept by reference, handed over at the end of its log
    interval and checked in one vectorised op at the next heartbeat; the first non-finite one is kept as
    `step * world + rank`, its flag travels in the heartbeat, and `check()` (then, and before each
    checkpoint: NaN weights are never saved) stops the run naming step and rank. skip: one host sync per
    step after the gradient all_reduce; a non-finite step is skipped on every rank alike and counted."""

    NONE = 2**62

    def __init__(self, mode: str, device: torch.device, rank: int, world_size: int):
        self.mode = mode
        self.rank = rank
        self.world = world_size
        self.device = device
        self._first = torch.full((), self.NONE, dtype=torch.int64, device=device)
        # kept micro-batch losses, and the (1-based) step of each
        self._losses = []
        self._steps = []

    def watch(self, losses: list[torch.Tensor], first_step: int, per_step: int) -> None:
        """Keep these micro-batch losses (detached; `per_step` of them per optimizer step, the
        first of step `first_step`, 1-based) for the next check."""
        if self.mode != "error":
            return
        self._losses += losses
        self._steps += [first_step + i // per_step for i in range(len(losses))]
        if len(self._losses) >= FOLD:
            self._fold()

    def _fold(self) -> None:
        """Check the kept losses on the device: the first non-finite one's code, no host sync."""
        if not self._losses:
            return
        try:
            losses = torch.stack(self._losses).reshape(-1)
        except RuntimeError:
            # shapes () and (1,) mixed: both are one-element losses
            losses = torch.stack([x.reshape(()) for x in self._losses])
        bad = ~torch.isfinite(losses)
        codes = on_device(self._steps, torch.int64, self.device) * self.world + self.rank
        self._first = torch.minimum(self._first, torch.where(bad, codes, self.NONE).min())
        self._losses = []
        self._steps = []

    def flag(self) -> torch.Tensor | None:
        """1.0 on the device when this rank has seen a non-finite loss: packed into the metrics'
        all_reduce at each log line, so checking costs no collective of its own."""
        if self.mode != "error":
            return None
        self._fold()
        return (self._first != self.NONE).double()

    def check(self) -> None:
        """Stop with a clear message when any rank saw a non-finite loss (a collective: before
        each checkpoint, and after a log line whose flag says so)."""
        if self.mode != "error":
            return
        self._fold()
        first = int(collectives.min(self._first.clone()).item())
        if first != self.NONE:
            step, rank = divmod(first, self.world)
            raise ConfigError(
                f"the loss is not a finite number (NaN or inf) at step {step} on rank {rank}; the run stopped "
                "before saving it, earlier checkpoints are kept",
                "lower the learning rate, clip gradients (trainer.grad_clip=1.0) or check the data; "
                "trainer.nonfinite=skip skips such steps instead",
            )

    def gradients_finite(self, models: list[nn.Module]) -> bool:
        """Whether every gradient is finite (the same answer on every rank after DDP's all_reduce)."""
        flags = [torch.isfinite(p.grad).all() for m in models for p in m.parameters() if p.grad is not None]
        return bool(torch.stack(flags).all()) if flags else True
